"""The same burst on BullMQ for Node, beside Sluice's, in the same run and on the same Redis.

The peer harness (bench-peers) measures BullMQ's throughput and round trip,
not a burst, so the burst's BullMQ side is ours: ``bullmq_burst.js`` next to
this module. It mirrors :mod:`sluice_lab.burst` step for step: the same
number of worker processes at the same concurrency, already registered with
Redis before the add; all N jobs in one ``Queue.addBulk``; the waiting and
active counts and the jobs' own ``HINCRBY`` counter sampled every 10 ms from
just before the add until every job has counted itself; lost/duplicates
from that counter after a 0.5 s settle.

Latency comes from BullMQ's own job stamps (``timestamp``, ``processedOn``,
``finishedOn``; whole milliseconds), every completed job of the burst, and
the percentiles are exact, taken at the same rank as Sluice's sketch
(``floor(q * (n - 1))`` of the sorted values), so only the sketch's 1 %
stands between the two columns.

BullMQ is never installed at run time: :func:`find_bullmq` says how to
install the pinned versions (those of the peer harness's reference runs)
outside the project when they are missing.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sluice.engine.sketch import METRICS
from sluice_lab.burst import since_add, summarize
from sluice_lab.common import new_queue_name
from sluice_lab.stats import rate

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from sluice_lab.burst import BurstSpec

#: The name of the peer in options and in the JSON.
PEER = "bullmq-node"
#: The versions of the peer harness's reference runs (bench-peers/setup.sh).
PINNED = {"bullmq": "6.7.0", "ioredis": "6.0.0"}
#: The Node side of the burst.
SCRIPT = Path(__file__).with_name("bullmq_burst.js")
#: Where the peer harness's setup.sh installs Node BullMQ (its $BENCH_HOME default).
DEFAULT_NODE_MODULES = Path.home() / ".cache" / "bench-peers" / "node-bullmq" / "node_modules"
#: The line the Node side prints its result on.
MARK = "@@BURST@@ "
#: Seconds on top of the drain's own limit for start-up, the stamps and the clean-up.
EXTRA_S = 90.0
#: Why end-to-end by stamps and "since the add" differ, said in the JSON.
STAMPS_NOTE = (
    "Stamps: Sluice's queue wait and end to end start when the job's chunk (64 jobs) of add_bulk reaches "
    "Redis; BullMQ's when the client builds the job, before addBulk sends its one MULTI. since_add "
    "measures both from the add call, off the same 10 ms samples."
)
#: The quantiles reported, as in Sluice's sketch.
QUANTILES = {"p50": 0.50, "p95": 0.95, "p99": 0.99}


class PeerUnavailable(RuntimeError):
    """Node or BullMQ is missing; the message says how to install them."""


class PeerFailed(RuntimeError):
    """The Node side ran but gave no result; the message holds its exit code and error output."""


@dataclass(frozen=True, slots=True)
class BullmqSetup:
    """A Node binary and a node_modules folder that holds bullmq and ioredis."""

    node: str
    node_modules: Path
    versions: dict[str, str]


def install_hint(node_modules: Path) -> str:
    """The commands that install the pinned BullMQ where :func:`find_bullmq` looks for it."""
    folder = node_modules.parent
    pins = " ".join(f"{pkg}@{version}" for pkg, version in PINNED.items())
    return (
        f"mkdir -p {folder} && cd {folder} && npm init -y && npm install {pins}"
        " (Node.js 18 or newer and npm: e.g. apt-get install nodejs npm); "
        "or pass --node-modules with a node_modules folder that has them"
    )


def find_bullmq(node_modules: Path | None = None) -> BullmqSetup:
    """Node on PATH and bullmq + ioredis in ``node_modules``; :class:`PeerUnavailable` otherwise."""
    folder = (node_modules or DEFAULT_NODE_MODULES).expanduser()
    node = shutil.which("node")
    if node is None:
        raise PeerUnavailable(f"no 'node' on PATH for the BullMQ side. Install: {install_hint(folder)}")
    versions: dict[str, str] = {}
    for pkg in PINNED:
        manifest = folder / pkg / "package.json"
        try:
            versions[pkg] = str(json.loads(manifest.read_text())["version"])
        except (OSError, ValueError, KeyError):
            raise PeerUnavailable(
                f"{pkg} is not installed in {folder} (no {manifest}). Install: {install_hint(folder)}"
            ) from None
    return BullmqSetup(node, folder, versions)


def node_url(url: str) -> str:
    """The Redis URL for the Node side: TCP on loopback only (like the peer harness)."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise PeerUnavailable(
            f"the BullMQ side needs a redis:// URL on loopback (127.0.0.1), not {parts.scheme}://"
            f"{parts.hostname or parts.path}; omit --redis to use a throw-away server"
        )
    return url


def parse_output(stdout: str, stderr: str, returncode: int | None) -> dict[str, Any]:
    """The result line of ``bullmq_burst.js burst``; :class:`PeerFailed` when there is none."""
    for line in stdout.splitlines():
        if line.startswith(MARK):
            try:
                data: dict[str, Any] = json.loads(line[len(MARK) :])
            except ValueError as exc:
                raise PeerFailed(f"the BullMQ side printed a broken result line: {exc}") from None
            return data
    raise PeerFailed(f"the BullMQ side gave no result (exit code {returncode}): {stderr.strip()[-800:]}")


def rank_quantiles(values: Sequence[float]) -> dict[str, Any]:
    """Count, p50/p95/p99 at rank ``floor(q * (n - 1))`` (Sluice's sketch's rank) and max, exactly."""
    ordered = sorted(values)
    n = len(ordered)
    out: dict[str, Any] = {"count": n}
    for name, q in QUANTILES.items():
        out[name] = float(ordered[math.floor(q * (n - 1))]) if n else None
    out["max"] = float(ordered[-1]) if n else None
    return out


def to_run(raw: Mapping[str, Any]) -> dict[str, Any]:
    """One Node result in the shape of a Sluice run (``burst.summarize`` reads both)."""
    run = {k: v for k, v in raw.items() if k != "durations_ms"}
    durations = raw.get("durations_ms") or {}
    n = int(raw["jobs"])
    metrics = {m: rank_quantiles(durations.get(m) or []) for m in METRICS}
    run["rate"] = rate(n, raw.get("drain_s"))
    run["latency"] = {"source": "BullMQ job stamps (whole ms), exact", "metrics": metrics}
    run["since_add"] = since_add(raw.get("timeline", {}).get("rows") or [], n)
    warnings = list(raw.get("warnings") or [])
    if any(metrics[m]["count"] != n for m in METRICS):
        warnings.append(f"job stamps counted {[metrics[m]['count'] for m in METRICS]} != {n} jobs")
    run["warnings"] = warnings
    return run


async def bullmq_burst_once(setup: BullmqSetup, url: str, spec: BurstSpec) -> dict[str, Any]:
    """Run one burst on BullMQ (its own worker processes, a fresh queue dropped after)."""
    name = new_queue_name("burst")
    env = {
        "PATH": str(Path(setup.node).parent),
        "NODE_PATH": str(setup.node_modules),
        "BURST_REDIS_URL": node_url(url),
        "BURST_QUEUE": name,
        "BURST_DONE_KEY": f"{name}:bench-done",
    }
    args = [str(spec.jobs), str(spec.processes), str(spec.concurrency), str(spec.work_ms), str(spec.timeout)]
    proc = await asyncio.create_subprocess_exec(
        setup.node,
        str(SCRIPT),
        "burst",
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), spec.timeout + EXTRA_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise PeerFailed(f"the BullMQ side did not finish within {spec.timeout + EXTRA_S:g} s") from None
    return to_run(parse_output(out.decode(), err.decode(), proc.returncode))


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    if mine is None or theirs is None or theirs <= 0:
        return None
    return round(mine / theirs, 3)


def ratios(
    sluice_rows: Sequence[Mapping[str, Any]], peer_rows: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Sluice / BullMQ of the medians per burst size: drain, p95/p99 of each metric (< 1: Sluice less)."""
    theirs = {row["jobs"]: row for row in peer_rows}
    out = []
    for row in sluice_rows:
        peer = theirs.get(row["jobs"])
        if peer is None:
            continue
        entry: dict[str, Any] = {"jobs": row["jobs"], "drain_s": _ratio(row["drain_s"], peer["drain_s"])}
        for metric in (*METRICS, "since_add"):
            mine, theirs_ = row.get(metric) or {}, peer.get(metric) or {}
            entry[metric] = {q: _ratio(mine.get(q), theirs_.get(q)) for q in ("p95", "p99")}
        out.append(entry)
    return out


def with_peer(data: dict[str, Any], setup: BullmqSetup, peer_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``data`` (a Sluice burst result) with the BullMQ side and the ratios added."""
    peer_summary = summarize(peer_runs)
    data["peer"] = {
        "name": PEER,
        "versions": setup.versions,
        "latency_note": STAMPS_NOTE,
        "summary": peer_summary,
        "runs": peer_runs,
    }
    data["ratios"] = ratios(data["summary"], peer_summary)
    return data
