// Sluice dashboard: plain JavaScript, no build step. Everything it shows comes from the API's
// routes, called with the key the user gave (kept in this tab's sessionStorage); data is put
// into the page as text, never as HTML.
"use strict";
(() => {
  const API = document.querySelector('meta[name="sluice-api"]').content || "..";
  const BASE = new URL(API.endsWith("/") ? API : API + "/", document.baseURI);
  const AUTH = document.querySelector('meta[name="sluice-auth"]').content;
  const KEY_ITEM = "sluice-api-key";
  const STATUSES = ["QUEUED", "PARKED", "PROCESSING", "COMPLETED", "FAILED", "DEAD_LETTER", "CANCELLED", "REJECTED"];
  const RATE_POINTS = 300;

  let key = sessionStorage.getItem(KEY_ITEM) || "";
  let me = null;
  let last = null;
  let liveAbort = null;
  let stopped = false; // signed out or refused: the loops end
  const rates = [[], [], [], []]; // time, added, completed, failed
  let ratesChart = null;
  let latencyChart = null;
  let deadCursor = null;
  let analysing = 0; // analyses in progress: the patterns table is not rebuilt under them
  let jobsCursor = null;
  let jobsQuery = {}; // the search the cursor belongs to

  const $ = (sel) => document.querySelector(sel);
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
    return node;
  }

  const fmt = (n) => (n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"));
  const fmtRate = (n) => (n === null || n === undefined ? "-" : n < 10 ? n.toFixed(1) : Math.round(n).toLocaleString("en-US"));
  const fmtMs = (n) => (n === null || n === undefined ? "-" : n < 10 ? n.toFixed(2) : n < 1000 ? n.toFixed(1) : (n / 1000).toFixed(2) + " s");
  const fmtDur = (n) => (n < 1000 ? `${Math.round(n)} ms` : n < 120000 ? `${(n / 1000).toFixed(2)} s` : fmtIn(n));
  const short = (text, n) => (!text ? "-" : text.length > n ? text.slice(0, n) + "..." : text);
  const fmtTime = (v) => (v ? new Date(v).toLocaleString("en-GB", { hour12: false }) : "-");
  function fmtIn(ms) {
    const s = Math.round(ms / 1000);
    if (s < 90) return `${s} s`;
    if (s < 5400) return `${Math.round(s / 60)} min`;
    if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
    return `${(s / 86400).toFixed(1)} days`;
  }

  function url(path, params) {
    const u = new URL(path, BASE);
    for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null && v !== "") u.searchParams.set(k, v);
    return u;
  }

  function headers(extra) {
    const h = { Accept: "application/json", ...(extra || {}) };
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function api(path, { method = "GET", body, params } = {}) {
    const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
    if (body !== undefined) init.body = JSON.stringify(body);
    const r = await fetch(url(path, params), init);
    let data = null;
    try { data = await r.json(); } catch (_) { data = null; }
    if (!r.ok) {
      const err = new Error((data && data.error && data.error.message) || `HTTP ${r.status}`);
      err.status = r.status;
      if (r.status === 401) showLogin("The key was refused: " + err.message);
      throw err;
    }
    return data;
  }

  function banner(message) {
    const b = $("#banner");
    b.textContent = message || "";
    b.hidden = !message;
  }

  // ---- sign in ----------------------------------------------------------------------------------
  function showLogin(message) {
    if (liveAbort) liveAbort.abort();
    stopped = true;
    $("#main").hidden = true;
    $("#login").hidden = false;
    $("#login-error").textContent = message || "";
    $("#sign-out").hidden = true;
  }

  // A new key, or none, starts a new page: nothing of the last key's view stays behind.
  $("#login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_ITEM, $("#key").value.trim());
    $("#key").value = "";
    location.reload();
  });
  $("#sign-out").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    location.reload();
  });

  async function start() {
    if (AUTH === "required" && !key) { showLogin(""); return; }
    try {
      me = await api("v1/me");
    } catch (e) {
      if (e.status !== 401) { showLogin("The API cannot be reached: " + e.message); }
      return;
    }
    $("#login").hidden = true;
    $("#main").hidden = false;
    $("#who").textContent = "tenant " + me.tenant;
    const role = $("#role");
    role.textContent = me.admin ? "admin" : "read-only";
    role.className = "badge" + (me.admin ? " admin" : "");
    document.body.classList.toggle("readonly", !me.admin);
    $("#sign-out").hidden = !me.auth;
    $("#budgets-note").textContent = me.admin ? "" : "Budgets are shown to admin keys only.";
    showTab();
    live();
    latencyLoop();
    patternsLoop();
  }

  // ---- tabs -------------------------------------------------------------------------------------
  function showTab() {
    const name = (location.hash || "#overview").slice(1);
    const tab = ["overview", "budgets", "failures", "jobs"].includes(name) ? name : "overview";
    for (const t of document.querySelectorAll(".tab")) t.hidden = t.id !== "tab-" + tab;
    for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.tab === tab);
    if (tab === "failures") loadFailures();
    if (tab === "jobs" && !$("#jobs-table tbody").children.length) searchJobs();
    if (tab === "overview") { resizeCharts(); }
    if (tab === "budgets" && last) renderBudgets(last.budgets);
  }
  window.addEventListener("hashchange", showTab);

  // ---- the live stream --------------------------------------------------------------------------
  function setConn(state) {
    const c = $("#conn");
    c.className = "dot " + state;
    c.textContent = state === "live" ? "live" : state === "down" ? "reconnecting" : "connecting";
  }

  async function live() {
    if (liveAbort) liveAbort.abort();
    const abort = new AbortController();
    liveAbort = abort;
    while (!abort.signal.aborted) {
      try {
        const r = await fetch(url("v1/live", { interval: 1 }), {
          headers: headers({ Accept: "text/event-stream" }),
          signal: abort.signal,
        });
        if (r.status === 401) { showLogin("The key was refused."); return; }
        if (!r.ok) throw new Error("HTTP " + r.status);
        setConn("live");
        const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value;
          let i;
          while ((i = buf.indexOf("\n\n")) >= 0) {
            onBlock(buf.slice(0, i));
            buf = buf.slice(i + 2);
          }
        }
      } catch (e) {
        if (abort.signal.aborted) return;
        setConn("down");
      }
      await sleep(1500);
    }
  }

  function onBlock(block) {
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) event = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
    }
    if (!data.length) return;
    const payload = JSON.parse(data.join("\n"));
    if (event === "snapshot") { setConn("live"); banner(""); onSnapshot(payload); }
    else if (event === "unavailable") { setConn("down"); banner(payload.message); }
  }

  function onSnapshot(s) {
    last = s;
    $("#queue-name").textContent = "queue " + s.queue;
    for (const [k, v] of Object.entries(s.states)) { const n = $("#state-" + k); if (n) n.textContent = fmt(v); }
    $("#total-completed").textContent = fmt(s.totals.completed);
    for (const k of ["added", "completed", "failed", "retried", "throttled"]) {
      $("#rate-" + k).textContent = s.rates ? fmtRate(s.rates[k]) : "-";
    }
    $("#workers").textContent = `${fmt(s.workers.count)} (${fmt(s.workers.slots)})`;
    renderFlow(s.flow, s.pressure);
    const refused = Object.entries(s.refusals).filter(([, n]) => n > 0).map(([gate, n]) => `${gate.replace("_", " ")} ${fmt(n)}`);
    $("#flow-refusals").textContent = refused.length ? refused.join(", ") + " (since the queue began)" : "none";
    if (s.rates) {
      rates[0].push(s.at);
      rates[1].push(s.rates.added);
      rates[2].push(s.rates.completed);
      rates[3].push(s.rates.failed);
      if (rates[0].length > RATE_POINTS) for (const r of rates) r.shift();
      drawRates();
    }
    if (!$("#tab-budgets").hidden) renderBudgets(s.budgets);
  }

  function renderFlow(f, p) {
    const now = Date.now();
    let state = f.paused ? "paused" : "running";
    if (f.throttled_until_ms && f.throttled_until_ms > now) state += `, throttled for ${fmtIn(f.throttled_until_ms - now)} more`;
    $("#flow-state").textContent = state;
    $("#flow-concurrency").textContent = f.concurrency ? `${fmt(f.active)} of ${fmt(f.concurrency)} running` : `${fmt(f.active)} running (no limit)`;
    // the longer windows of each kind (set_limits): hard caps beside the paced one
    const caps = (kind) => (f.windows || []).filter((w) => w.kind === kind && !w.paced)
      .map((w) => `; ${fmt(w.in_window)} of ${fmt(w.limit)} per ${w.per_seconds} s`).join("");
    $("#flow-rate").textContent = f.rate_max ? `${fmt(f.starts_in_window)} of ${fmt(f.rate_max)} starts per ${f.rate_per_seconds} s${caps("requests")}` : "no limit";
    const headroom = Math.max(f.headroom_ms, f.measured_headroom_ms);
    const measured = f.measured_headroom_ms ? `measured ${f.measured_headroom_ms} ms` : "none measured lately";
    const slowed = f.pace_factor_pm < 1000 ? `; at ${f.pace_factor_pm / 10} % of the limits after a 429` : "";
    $("#flow-pacing").textContent = !f.rate_max && !f.token_limit ? "no rate limit to pace"
      : f.pace_tolerance_ms === null ? `off: the limits admit in bursts (headroom ${headroom} ms)`
      : `starts spaced evenly, ${f.pace_tolerance_ms} ms of tolerance, ${headroom} ms of headroom per window (at least ${f.headroom_ms} ms; ${measured})${slowed}`;
    $("#flow-tokens").textContent = f.token_limit ? `${fmt(f.tokens_in_window)} of ${fmt(f.token_limit)} tokens per ${f.token_per_seconds} s${caps("tokens")}` : "no limit";
    $("#flow-pressure").textContent = `score ${p.score.toFixed(2)}${p.refusing ? " - refusing submissions" : ""}; ` +
      `depth ${fmt(p.depth)}, draining ${fmtRate(p.drain_rate)}/s` + (p.backlog_seconds !== null ? `, backlog ${fmtIn(p.backlog_seconds * 1000)}` : "");
  }

  // ---- charts -----------------------------------------------------------------------------------
  function chartWidth(id) { return Math.max(($(id).clientWidth || 900) - 14, 300); }

  function drawRates() {
    if (typeof uPlot === "undefined") return;
    if (!ratesChart) {
      ratesChart = new uPlot({
        width: chartWidth("#chart-rates"), height: 180,
        series: [{}, { label: "added/s", stroke: "#2563eb" }, { label: "completed/s", stroke: "#15803d" }, { label: "failed/s", stroke: "#b91c1c" }],
        axes: [{}, { size: 50 }],
      }, rates, $("#chart-rates"));
    } else if (!$("#tab-overview").hidden) {
      ratesChart.setData(rates);
    }
  }

  let latencySeq = 0;
  async function loadLatency() {
    const seq = ++latencySeq;
    const metric = $("#lat-metric").value;
    const span = Number($("#lat-window").value);
    const [series, stats] = await Promise.all([api("v1/stats/series", { params: { window: span } }), api("v1/stats")]);
    if (seq !== latencySeq) return; // a newer choice asked again meanwhile
    const pts = series.metrics[metric];
    const data = [series.starts_ms.map((t) => t / 1000), pts.map((p) => p.p50), pts.map((p) => p.p95), pts.map((p) => p.p99)];
    if (typeof uPlot !== "undefined") {
      if (!latencyChart) {
        latencyChart = new uPlot({
          width: chartWidth("#chart-latency"), height: 200,
          series: [{}, { label: "p50 ms", stroke: "#15803d" }, { label: "p95 ms", stroke: "#b45309" }, { label: "p99 ms", stroke: "#b91c1c" }],
          axes: [{}, { size: 60 }],
        }, data, $("#chart-latency"));
      } else {
        latencyChart.setData(data);
      }
    }
    const body = $("#lat-table tbody");
    body.replaceChildren();
    for (const name of ["queue_wait", "processing", "end_to_end"]) {
      const row = el("tr", { "data-metric": name }, el("th", {}, name.replace(/_/g, " ")));
      for (const label of ["1m", "5m", "1h"]) {
        const m = stats.windows[label].metrics[name];
        row.append(el("td", {}, m.count ? `${fmtMs(m.p50)} / ${fmtMs(m.p95)} / ${fmtMs(m.p99)}` : "-"));
      }
      row.append(el("td", {}, fmt(stats.windows["1h"].metrics[name].count)));
      body.append(row);
    }
  }

  async function latencyLoop() {
    while (!stopped) {
      if (!$("#main").hidden && !$("#tab-overview").hidden) {
        try { await loadLatency(); } catch (e) { if (e.status === 401) return; }
      }
      await sleep(10000);
    }
  }
  $("#lat-metric").addEventListener("change", () => loadLatency().catch(() => {}));
  $("#lat-window").addEventListener("change", () => loadLatency().catch(() => {}));

  function resizeCharts() {
    if (ratesChart) ratesChart.setSize({ width: chartWidth("#chart-rates"), height: 180 });
    if (latencyChart) latencyChart.setSize({ width: chartWidth("#chart-latency"), height: 200 });
  }
  window.addEventListener("resize", resizeCharts);

  // ---- flow control (admin) ---------------------------------------------------------------------
  async function flowAction(path, body) {
    const out = $("#flow-result");
    try {
      const f = await api(path, { method: "POST", body: body || {} });
      out.textContent = f.paused ? "paused" : "running";
    } catch (e) { out.textContent = e.message; }
  }
  $("#pause").addEventListener("click", () => flowAction("v1/queue/pause"));
  $("#resume").addEventListener("click", () => flowAction("v1/queue/resume"));
  $("#throttle").addEventListener("click", () => flowAction("v1/queue/throttle", { seconds: Number($("#throttle-seconds").value) }));

  // ---- budgets ----------------------------------------------------------------------------------
  function renderBudgets(budgets) {
    const body = $("#budgets-table tbody");
    body.replaceChildren();
    if (!budgets) {
      if (me && me.admin) body.append(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "Reading the budgets...")));
      return;
    }
    if (!budgets.length) { body.append(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "No budgets yet."))); return; }
    const now = Date.now();
    for (const b of budgets) {
      const cap = b.limit + b.credit;
      const frac = cap > 0 ? Math.min(b.used / cap, 1) : 1;
      const gauge = el("div", { class: "gauge" + (frac >= 1 ? " bad" : frac >= 0.8 ? " warn" : ""), title: `${Math.round(frac * 100)} %` }, el("div"));
      gauge.firstChild.style.width = (frac * 100).toFixed(1) + "%";
      let runs = "-";
      if (b.runs_out === "now") runs = "exhausted";
      else if (b.runs_out === "yes") runs = b.exhausts_at_ms - now < 1000 ? "any moment" : "in " + fmtIn(b.exhausts_at_ms - now);
      else if (b.runs_out === "after_reset") runs = "not before the window resets";
      else if (b.runs_out === "no") runs = "not at this rate";
      else runs = "measuring";
      body.append(el("tr", { "data-budget": b.name },
        el("td", {}, b.name, b.parent ? el("span", { class: "muted" }, " in " + b.parent) : ""),
        el("td", {}, gauge, `${fmt(b.used)} of ${fmt(cap)}`),
        el("td", {}, fmt(b.remaining)),
        el("td", { class: "burn" }, b.burn_per_minute === null ? "measuring" : fmtRate(b.burn_per_minute)),
        el("td", { class: "runs-out" }, runs),
        el("td", {}, b.resets_at_ms ? fmtTime(b.resets_at_ms) : b.window ? "-" : "never (no window)"),
        el("td", {}, fmt(b.parked))));
    }
  }

  // ---- dead letters and failure patterns --------------------------------------------------------
  async function loadFailures() {
    try {
      const [patterns, dead] = await Promise.all([
        api("v1/failures/patterns", { params: { limit: 50 } }),
        api("v1/dead-letters", { params: { limit: 50 } }),
      ]);
      renderPatterns(patterns.patterns);
      $("#dead-table tbody").replaceChildren();
      appendDead(dead);
    } catch (e) { banner(e.message); }
  }

  // Patterns again every 15 s while the tab shows (the dead list keeps its ticked boxes).
  async function patternsLoop() {
    while (!stopped) {
      await sleep(15000);
      if (!$("#main").hidden && !$("#tab-failures").hidden && !analysing) {
        try { renderPatterns((await api("v1/failures/patterns", { params: { limit: 50 } })).patterns); } catch (_) { /* next time */ }
      }
    }
  }

  function renderPatterns(patterns) {
    const body = $("#patterns-table tbody");
    body.replaceChildren();
    if (!patterns.length) { body.append(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "No failures recorded."))); return; }
    for (const p of patterns) {
      const cell = el("td", { class: "analysis" });
      if (p.analysis) cell.append(el("div", {}, p.analysis.root_cause), el("div", { class: "muted" }, p.analysis.fix));
      else if (p.analysis_state === "pending") cell.append("analysing...");
      else if (me.admin) cell.append(el("button", { type: "button", onclick: () => analyze(p.id, cell) }, "Analyse"));
      else cell.append(el("span", { class: "muted" }, "-"));
      if (p.analysis_error) cell.append(el("div", { class: "error" }, p.analysis_error));
      body.append(el("tr", { "data-pattern": p.id },
        el("td", { class: "cat " + p.category }, p.category),
        el("td", {}, p.job_type),
        el("td", {}, el("div", {}, p.error_type), el("div", { class: "muted" }, p.message)),
        el("td", {}, fmt(p.count)),
        el("td", {}, fmtTime(p.last_seen)),
        el("td", {}, p.advice),
        cell));
    }
  }

  async function analyze(id, cell) {
    cell.replaceChildren("analysing...");
    analysing++;
    try {
      let r = await api(`v1/failures/patterns/${encodeURIComponent(id)}/analysis`, { method: "POST", body: {} });
      for (let i = 0; i < 60 && r.state === "pending"; i++) {
        await sleep(2000);
        const p = await api(`v1/failures/patterns/${encodeURIComponent(id)}`);
        if (p.analysis) r = { state: "done", analysis: p.analysis };
        else if (p.analysis_error) throw new Error(p.analysis_error);
      }
      cell.replaceChildren();
      if (r.analysis) cell.append(el("div", {}, r.analysis.root_cause), el("div", { class: "muted" }, r.analysis.fix));
      else cell.append("still pending: look again later");
    } catch (e) { cell.replaceChildren(el("span", { class: "error" }, e.message)); }
    finally { analysing--; }
  }

  function appendDead(page) {
    const body = $("#dead-table tbody");
    if (!page.jobs.length && !body.children.length) body.append(el("tr", {}, el("td", { colspan: 6, class: "muted" }, "No dead-lettered jobs.")));
    for (const j of page.jobs) {
      const box = el("input", { type: "checkbox", value: j.id, "aria-label": "select " + j.id });
      body.append(el("tr", { "data-job": j.id },
        el("td", {}, me.admin ? box : ""),
        el("td", {}, el("a", { href: "#jobs", onclick: () => openJob(j.id) }, j.id)),
        el("td", {}, j.type), el("td", {}, `${j.attempts}/${j.max_attempts}`),
        el("td", { title: j.error || "" }, short(j.error, 160)), el("td", {}, fmtTime(j.updated_at))));
    }
    deadCursor = page.next_cursor;
    $("#dead-more").hidden = !deadCursor;
  }
  $("#dead-more").addEventListener("click", async () => {
    try { appendDead(await api("v1/dead-letters", { params: { limit: 50, cursor: deadCursor } })); } catch (e) { banner(e.message); }
  });

  $("#redrive-selected").addEventListener("click", async () => {
    const ids = [...document.querySelectorAll("#dead-table input:checked")].map((b) => b.value);
    const out = $("#redrive-result");
    if (!ids.length) { out.textContent = "select the jobs to redrive first"; return; }
    try {
      const r = await api("v1/dead-letters/redrive", { method: "POST", body: { ids } });
      out.textContent = `redriven: ${r.redriven}`;
      await sleep(500);
      loadFailures();
    } catch (e) { out.textContent = e.message; }
  });

  // ---- jobs ---------------------------------------------------------------------------------------
  for (const s of STATUSES) $("#search-status").append(el("option", { value: s }, s));

  function jobRow(j) {
    return el("tr", { class: "clickable", "data-job": j.id, onclick: () => openJob(j.id) },
      el("td", {}, j.id), el("td", {}, j.type), el("td", {}, j.status), el("td", {}, `${j.attempts}/${j.max_attempts}`),
      el("td", {}, fmtTime(j.created_at)), el("td", {}, fmtTime(j.updated_at)));
  }

  async function searchJobs(more) {
    const body = $("#jobs-table tbody");
    const id = $("#search-id").value.trim();
    try {
      if (id) {
        body.replaceChildren(jobRow(await api(`v1/jobs/${encodeURIComponent(id)}`)));
        $("#jobs-more").hidden = true;
        openJob(id);
        return;
      }
      if (!more) jobsQuery = { status: $("#search-status").value, type: $("#search-type").value.trim(), limit: 50 };
      const page = await api("v1/jobs", { params: { ...jobsQuery, cursor: more ? jobsCursor : null } });
      if (!more) body.replaceChildren();
      for (const j of page.jobs) body.append(jobRow(j));
      if (!body.children.length) body.append(el("tr", {}, el("td", { colspan: 6, class: "muted" }, "No jobs match.")));
      jobsCursor = page.next_cursor;
      $("#jobs-more").hidden = !jobsCursor;
    } catch (e) {
      body.replaceChildren(el("tr", {}, el("td", { colspan: 6, class: "error" }, e.message)));
    }
  }
  $("#job-search").addEventListener("submit", (ev) => { ev.preventDefault(); searchJobs(false); });
  $("#jobs-more").addEventListener("click", () => searchJobs(true));

  async function openJob(id) {
    if (location.hash !== "#jobs") location.hash = "#jobs";
    let job;
    try { job = await api(`v1/jobs/${encodeURIComponent(id)}`); } catch (e) { banner(e.message); return; }
    $("#job-detail").hidden = false;
    $("#job-id").textContent = job.id;
    $("#job-status").textContent = job.status;
    renderTimeline(job);
    const fields = $("#job-fields");
    fields.replaceChildren();
    const rows = [["type", job.type], ["queue", job.queue], ["priority", job.priority], ["attempts", `${job.attempts} of ${job.max_attempts}`],
      ["tokens reserved", fmt(job.tokens)], ["budget", job.budget || "-"], ["spent", fmt(job.spent)],
      ["correlation id", job.correlation_id || "-"], ["idempotency key", job.idempotency_key || "-"],
      ["created", fmtTime(job.created_at)], ["completed", fmtTime(job.completed_at)]];
    for (const [k, v] of rows) fields.append(el("tr", {}, el("th", {}, k), el("td", {}, String(v))));
    fields.append(el("tr", {}, el("th", {}, "error"), el("td", {}, el("pre", {}, job.error || "-"))));
    fields.append(el("tr", {}, el("th", {}, "payload"), el("td", {}, el("pre", {}, JSON.stringify(job.payload, null, 2)))));
    fields.append(el("tr", {}, el("th", {}, "result"), el("td", {}, el("pre", {}, JSON.stringify(job.result, null, 2)))));
  }

  function renderTimeline(job) {
    const box = $("#timeline");
    box.replaceChildren();
    const attempts = (job.attempt_list || []).slice().sort((a, b) => a.attempt - b.attempt || a.token - b.token);
    const t0 = Date.parse(job.created_at);
    const ends = attempts.map((a) => Date.parse(a.finished_at || a.started_at));
    const t1 = Math.max(t0 + 1, Date.parse(job.updated_at), ...ends, job.completed_at ? Date.parse(job.completed_at) : 0);
    const span = t1 - t0;
    const bar = (from, to, cls, title) => {
      const b = el("div", { class: "bar " + cls, title });
      b.style.left = ((from - t0) / span * 100).toFixed(2) + "%";
      b.style.width = (Math.max(to - from, 0) / span * 100).toFixed(2) + "%";
      return b;
    };
    if (!attempts.length) {
      box.append(el("div", { class: "muted" }, `no attempt yet (created ${fmtTime(job.created_at)})`));
      return;
    }
    for (const a of attempts) {
      const s = Date.parse(a.started_at);
      const f = a.finished_at ? Date.parse(a.finished_at) : Date.now();
      const took = a.finished_at ? fmtDur(f - s) : "running";
      const lane = el("div", { class: "lane" }, bar(s, f, a.outcome || "running", `${a.outcome || "running"}: ${took}`));
      box.append(el("div", { class: "row attempt", "data-outcome": a.outcome || "running" },
        el("span", { class: "who" }, `#${a.attempt}`), lane,
        el("span", { class: "what", title: a.error || "" }, `${a.outcome || "running"} in ${took}${a.worker ? " on " + a.worker : ""}${a.error ? ": " + a.error : ""}`)));
    }
    box.append(el("div", { class: "muted" }, `from creation ${fmtTime(job.created_at)} to ${fmtTime(t1)} (${fmtDur(span)})`));
  }

  start();
})();
