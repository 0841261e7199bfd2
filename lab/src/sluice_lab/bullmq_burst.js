#!/usr/bin/env node
// The BullMQ (Node) side of `sluice bench burst --peer bullmq-node`: the same burst as Sluice's side.
//
//   node bullmq_burst.js burst <jobs> <processes> <concurrency> <workMs> <timeoutS>
//       starts <processes> worker children (this file, mode "worker"), waits until every one is
//       registered with Redis, adds <jobs> with one Queue.addBulk and samples the queue every 10 ms
//       until every job has counted itself; then reads the jobs' own timestamps and prints one line
//       "@@BURST@@ {json}" (sluice_lab/burst_peer.py parses it and computes the percentiles).
//   node bullmq_burst.js worker
//       one Worker(concurrency) whose job sleeps data.ms (if any), HINCRBYs the done key, returns 1.
//
// Environment: BURST_REDIS_URL (loopback TCP only), BURST_QUEUE, BURST_DONE_KEY; the driver sets
// BURST_WORKER_ID and BURST_CONCURRENCY for its children. bullmq and ioredis come from NODE_PATH.
// Every loop is bounded in time; the queue and the done key are deleted at the end.
'use strict';
const { spawn } = require('child_process');
const { Queue, Worker } = require('bullmq');
const IORedis = require('ioredis');

const MARK = '@@BURST@@ ';
const SAMPLE_MS = 10;
const SETTLE_MS = 500;
const READY_TIMEOUT_MS = 60000;
const EXIT_TIMEOUT_MS = 15000;
const PAGE = 1000;

function connectionOf(raw) {
  const url = new URL(raw);
  if (!['127.0.0.1', 'localhost', '[::1]', '::1'].includes(url.hostname)) {
    console.error(`loopback Redis only, got ${url.hostname}`);
    process.exit(2);
  }
  const conn = {
    host: url.hostname.replace(/^\[|\]$/g, ''),
    port: Number(url.port || 6379),
    db: Number((url.pathname || '/0').slice(1) || 0),
    maxRetriesPerRequest: null,
  };
  if (url.password) conn.password = decodeURIComponent(url.password);
  if (url.username) conn.username = decodeURIComponent(url.username);
  return conn;
}

const connection = connectionOf(process.env.BURST_REDIS_URL || 'redis://127.0.0.1:6379/0');
const QUEUE = process.env.BURST_QUEUE || 'bench-burst';
const DONE_KEY = process.env.BURST_DONE_KEY || `${QUEUE}:bench-done`;
const nowMs = () => Number(process.hrtime.bigint()) / 1e6;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const round = (x, d) => Math.round(x * 10 ** d) / 10 ** d;

async function worker() {
  const wid = process.env.BURST_WORKER_ID || `w${process.pid}`;
  const concurrency = Number(process.env.BURST_CONCURRENCY || 10);
  const r = new IORedis(connection);
  const w = new Worker(
    QUEUE,
    async (job) => {
      const ms = job.data && job.data.ms;
      if (ms > 0) await sleep(ms);
      await r.hincrby(DONE_KEY, wid, 1);
      return 1;
    },
    { connection, concurrency, name: wid },
  );
  w.on('error', (e) => console.error('worker error', e));
  await w.waitUntilReady();
  console.log('ready');
  let closing = false;
  const stop = async () => {
    if (closing) return;
    closing = true;
    const t = setTimeout(() => process.exit(1), EXIT_TIMEOUT_MS);
    await w.close();
    await r.quit();
    clearTimeout(t);
    process.exit(0);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

function startWorkers(processes, concurrency) {
  const children = [];
  for (let i = 0; i < processes; i++) {
    const child = spawn(process.execPath, [__filename, 'worker'], {
      env: { ...process.env, BURST_WORKER_ID: `bullmq-${i}`, BURST_CONCURRENCY: String(concurrency) },
      stdio: ['ignore', 'ignore', 'pipe'],
    });
    child.stderrTail = '';
    child.stderr.on('data', (d) => { child.stderrTail = (child.stderrTail + d).slice(-800); });
    child.exited = new Promise((resolve) => child.on('exit', (code) => { child.exitCode_ = code; resolve(code); }));
    children.push(child);
  }
  return children;
}

async function untilServing(q, children) {
  const t0 = nowMs();
  while ((await q.getWorkersCount()) < children.length) {
    const dead = children.filter((c) => c.exitCode_ !== undefined);
    if (dead.length) throw new Error(`worker exited at start: ${dead.map((c) => c.stderrTail).join('; ')}`);
    if (nowMs() - t0 > READY_TIMEOUT_MS) throw new Error(`fewer than ${children.length} workers within 60 s`);
    await sleep(50);
  }
  return round((nowMs() - t0) / 1000, 3);
}

async function doneCounts(r) {
  const raw = await r.hgetall(DONE_KEY);
  const out = {};
  for (const [k, v] of Object.entries(raw)) out[k] = Number(v);
  return out;
}

const sum = (o) => Object.values(o).reduce((a, b) => a + b, 0);

async function stopWorkers(children) {
  const t0 = nowMs();
  for (const c of children) if (c.exitCode_ === undefined) c.kill('SIGTERM');
  let timer;
  const late = new Promise((resolve) => { timer = setTimeout(() => resolve(true), EXIT_TIMEOUT_MS + 2000); });
  const timedOut = await Promise.race([Promise.all(children.map((c) => c.exited)).then(() => false), late]);
  clearTimeout(timer);
  if (timedOut) for (const c of children) if (c.exitCode_ === undefined) c.kill('SIGKILL');
  return round((nowMs() - t0) / 1000, 3);
}

async function timestamps(q, n) {
  // BullMQ's own stamps (ms since the epoch): timestamp (added), processedOn (taken), finishedOn.
  const wait = [];
  const processing = [];
  const endToEnd = [];
  for (let start = 0; start < n; start += PAGE) {
    const jobs = await q.getJobs(['completed'], start, start + PAGE - 1, true);
    for (const job of jobs) {
      if (job.processedOn == null || job.finishedOn == null) continue;
      wait.push(job.processedOn - job.timestamp);
      processing.push(job.finishedOn - job.processedOn);
      endToEnd.push(job.finishedOn - job.timestamp);
    }
    if (jobs.length < PAGE) break;
  }
  return { queue_wait: wait, processing, end_to_end: endToEnd };
}

async function burst(n, processes, concurrency, workMs, timeoutS) {
  const q = new Queue(QUEUE, { connection });
  const r = new IORedis(connection);
  await q.waitUntilReady();
  const children = startWorkers(processes, concurrency);
  const out = { jobs: n, processes, concurrency, work_ms: workMs, warnings: [] };
  try {
    out.workers_serving_after_s = await untilServing(q, children);
    const samples = [];
    let stop = false;
    let finishedAt = null;
    let t0 = 0;
    const sampler = async () => {
      let tick = nowMs();
      for (;;) {
        const counts = await q.getJobCounts('waiting', 'active');
        const done = sum(await doneCounts(r));
        const now = nowMs();
        samples.push([round(now - t0, 2), counts.waiting, counts.active, done]);
        if (done >= n) { finishedAt = now; return; }
        if (stop) return;
        tick += SAMPLE_MS;
        await sleep(Math.max(0, tick - nowMs()));
      }
    };
    const data = workMs > 0 ? { ms: workMs } : {};
    const jobs = new Array(n);
    for (let i = 0; i < n; i++) jobs[i] = { name: 'burst', data };
    t0 = nowMs();
    const sampling = sampler();
    await q.addBulk(jobs);
    out.add_s = round((nowMs() - t0) / 1000, 4);
    let limit;
    const late = new Promise((resolve) => { limit = setTimeout(() => resolve('late'), timeoutS * 1000); });
    if ((await Promise.race([sampling.then(() => 'done'), late])) === 'late') {
      out.warnings.push(`time limit of ${timeoutS} s reached before every job was done`);
      stop = true;
      await sampling;
    }
    clearTimeout(limit);
    const drainS = finishedAt === null ? null : (finishedAt - t0) / 1000;
    await sleep(SETTLE_MS);
    const final = await doneCounts(r);
    const total = sum(final);
    Object.assign(out, {
      complete: finishedAt !== null,
      drain_s: drainS === null ? null : round(drainS, 4),
      peak_waiting: Math.max(0, ...samples.map((s) => s[1])),
      peak_active: Math.max(0, ...samples.map((s) => s[2])),
      sample_interval_ms: SAMPLE_MS,
      samples: samples.length,
      completed: total,
      duplicates: Math.max(0, total - n),
      lost_or_unfinished: Math.max(0, n - total),
      per_worker: final,
      engine_counts: await q.getJobCounts('waiting', 'active', 'completed', 'failed', 'delayed'),
      timeline: { columns: ['ms', 'waiting', 'active', 'done'], rows: samples },
      durations_ms: await timestamps(q, n),
    });
    out.graceful_exit_s = await stopWorkers(children);
  } finally {
    await stopWorkers(children);
    await q.obliterate({ force: true }).catch((e) => console.error('obliterate', e && e.message));
    await r.del(DONE_KEY);
    await q.close();
    await r.quit();
  }
  return out;
}

async function main() {
  const [mode, ...a] = process.argv.slice(2);
  if (mode === 'worker') return worker();
  if (mode === 'burst') {
    const out = await burst(Number(a[0]), Number(a[1]), Number(a[2]), Number(a[3] || 0), Number(a[4] || 120));
    console.log(MARK + JSON.stringify(out));
    return undefined;
  }
  console.error('usage: bullmq_burst.js burst <jobs> <processes> <concurrency> <workMs> <timeoutS> | worker');
  process.exit(2);
  return undefined;
}

main().catch((e) => { console.error(e && e.stack ? e.stack : e); process.exit(1); });
