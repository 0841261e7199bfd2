"""The KEYS and ARGV of every engine script, built in this one module.

Each method names its script and lays out what the script reads, in the
order its ``lua/<name>.lua`` header documents; the parts of a queue call
``core.run(core.commands.<script>(...))`` and parse the reply themselves.
So a script's calling convention is changed in two files, this one and the
script, and a test (tests/engine/test_commands.py) checks each builder
against the KEYS and ARGV its script indexes. The pump and the watchdog
send the dispatch call on connections of their own: they take the
:class:`Call` and send its keys and args there.

No Redis here, and no validation: the parts check their input first, so
that a bad call fails before anything is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from sluice.engine.budget_state import TOKEN_RATE_BUDGET
from sluice.engine.clock import script_now

if TYPE_CHECKING:
    from sluice.engine.job import JobSpec
    from sluice.engine.keys import QueueKeys

#: One finished attempt as the worker reports it: (job id, token, kind (a
#: wireformat.Kind), value, retry in ms from now (kind FAILED), tokens used or -1).
Outcome = tuple[str, bytes, bytes, bytes, int, int]


class Call(NamedTuple):
    """One script call, ready to send: the script's name (scripts.COMMANDS), KEYS, ARGV."""

    script: str
    keys: list[str]
    args: list[Any]


class Commands:
    """One queue's script calls: ``core.commands``."""

    __slots__ = ("_events_maxlen", "_idempotency_ttl_ms", "_result_max_bytes", "keys")

    def __init__(
        self, keys: QueueKeys, *, events_maxlen: int, event_result_max_bytes: int, idempotency_ttl_ms: int
    ) -> None:
        self.keys = keys
        self._events_maxlen = events_maxlen
        self._result_max_bytes = event_result_max_bytes
        self._idempotency_ttl_ms = idempotency_ttl_ms

    # -- producers ---------------------------------------------------------------------------

    def add(self, specs: Sequence[JobSpec], encoded: Sequence[tuple[list[str], bytes]]) -> Call:
        """Add jobs: per job its packed options (``encoded``'s list, then the index of its
        idempotency key among the KEYS, its trace context and its caller's id) and payload.
        Jobs that share an idempotency key share its KEYS entry."""
        k = self.keys
        keys = [k.seq, k.waiting, k.delayed, k.events, k.wake, k.stats, k.job_prefix, k.budget_prefix]
        fixed = len(keys)
        idem_index: dict[str, int] = {}
        args: list[Any] = [script_now(None), self._events_maxlen, self._idempotency_ttl_ms, len(specs)]
        for spec, (options, payload) in zip(specs, encoded, strict=True):
            index = 0
            if spec.idempotency_key is not None:
                index = idem_index.get(spec.idempotency_key, 0)
                if not index:
                    keys.append(k.idem(spec.idempotency_key))
                    index = idem_index[spec.idempotency_key] = len(keys) - fixed
            args.append(orjson.dumps([*options, str(index), spec.trace_context or "", spec.job_id or ""]))
            args.append(payload)
        return Call("add", keys, args)

    def cancel(self, job_id: str, *, ahead: bool, now: int | None = None) -> Call:
        k = self.keys
        keys = [
            k.job(job_id),
            k.waiting,
            k.delayed,
            k.events,
            k.stats,
            k.parked_prefix,
            k.retention,
            k.finished_prefix,
        ]
        return Call("cancel", keys, [script_now(now), job_id, self._events_maxlen, "1" if ahead else ""])

    # -- workers -----------------------------------------------------------------------------

    def dispatch(
        self,
        *,
        now: int | None = None,
        want: int,
        lease_ms: int,
        worker_id: str,
        outcomes: Sequence[Outcome] = (),
        request_id: str = "",
    ) -> Call:
        """Hand in ``outcomes`` (their job keys after the fixed ones), lease up to ``want``."""
        k = self.keys
        keys = [k.waiting, k.delayed, k.active, k.events, k.stats, k.wake, k.job_prefix, k.dead, *k.flow]
        keys += (k.calls, k.epoch, k.retention, k.finished_prefix)
        args: list[Any] = [
            script_now(now),
            want,
            lease_ms,
            worker_id,
            self._events_maxlen,
            self._result_max_bytes,
            len(outcomes),
            request_id,
        ]
        job_prefix = k.job_prefix
        for outcome in outcomes:
            if len(outcome) != 6:
                raise ValueError(
                    f"an outcome is (job id, token, kind, value, retry in ms, tokens used), got {outcome!r}"
                )
            keys.append(job_prefix + outcome[0])
            args += outcome
        return Call("dispatch", keys, args)

    def extend(self, *, now: int | None, lease_ms: int, leases: Sequence[tuple[str, bytes]]) -> Call:
        keys = [self.keys.active, *(self.keys.job(job_id) for job_id, _ in leases)]
        args: list[Any] = [script_now(now), lease_ms]
        for job_id, token in leases:
            args += (job_id, token)
        return Call("extend", keys, args)

    def reap(self, *, now: int | None, limit: int) -> Call:
        k = self.keys
        keys = [k.active, k.waiting, k.dead, k.events, k.stats, k.wake, k.job_prefix, *k.flow]
        keys += (k.retention, k.finished_prefix)
        return Call("reap", keys, [script_now(now), limit, self._events_maxlen])

    def trim(self, *, now: int | None, limit: int) -> Call:
        k = self.keys
        keys = [k.retention, k.finished_prefix, k.dead, k.job_prefix, k.reservation_prefix]
        return Call("trim", keys, [script_now(now), limit])

    def heartbeat(self, worker_id: str, description: bytes, ttl_ms: int, *, leaving: bool) -> Call:
        k = self.keys
        args = [script_now(None), worker_id, description, ttl_ms, 1 if leaving else 0]
        return Call("heartbeat", [k.workers, k.alive, k.calls], args)

    def lag(self, worker_id: str, low: str, high: str, ttl_ms: int, *, withdraw: bool) -> Call:
        """Report a worker's dispatch-to-send delays (ms, formatted), or withdraw them."""
        k = self.keys
        keys = [k.control, k.lags, k.budget_prefix, k.budget_log_prefix]
        return Call("lag", keys, [script_now(None), worker_id, low, high, ttl_ms, int(withdraw)])

    def observe(self, seen: Iterable[Any]) -> Call:
        """What providers said of their limits: the flat args of each report."""
        return Call("observe", self.keys.flow, [script_now(None), *seen])

    def latency(
        self,
        short: str,
        *,
        bucket_10s: int,
        bucket_1m: int,
        priority: str,
        other: str,
        keep_ms: tuple[int, int],
        bins: Sequence[tuple[str, int]],
    ) -> Call:
        """Add counts to one metric's latency bins (10-second and 1-minute buckets, and the
        cumulative ones of its priority and of ``other``, every priority's)."""
        k = self.keys
        keys = [
            k.latency(short, "10s", bucket_10s),
            k.latency(short, "1m", bucket_1m),
            k.latency_total(short, priority),
            k.latency_total(short, other),
            k.latency_priorities,
        ]
        args: list[Any] = [keep_ms[0], keep_ms[1], priority]
        for field, count in bins:
            args += (field, count)
        return Call("latency", keys, args)

    # -- operators ---------------------------------------------------------------------------

    def redrive(self, job_ids: Sequence[str]) -> Call:
        k = self.keys
        keys = [k.dead, k.waiting, k.events, k.wake, *(k.job(i) for i in job_ids)]
        return Call("redrive", keys, [self._events_maxlen, *job_ids])

    def purge(self, job_ids: Sequence[str]) -> Call:
        k = self.keys
        return Call("purge", [k.dead, k.reservation_prefix, *(k.job(i) for i in job_ids)], list(job_ids))

    def retention(self) -> Call:
        return Call("retention", [self.keys.retention], [])

    def now(self) -> Call:
        """Redis's clock on the queue's server."""
        return Call("now", [self.keys.control], [script_now(None)])

    def pace(self, args: Sequence[Any]) -> Call:
        """Set a kind's rate windows (``kind, which, refund, ms, limit, ...``) or the pacer
        (``"pacing", tolerance, headroom``)."""
        k = self.keys
        keys = [k.control, k.budget_prefix + TOKEN_RATE_BUDGET, k.wake, k.budget_prefix, k.budget_log_prefix]
        return Call("pace", keys, list(args))

    # -- the token ledger --------------------------------------------------------------------

    def budget_read(self, names: Sequence[str], *, now: int | None) -> Call:
        return Call("budget_read", self.keys.flow, [script_now(now), *names])

    def budget_restore(self, values: Sequence[Any], *, now: int | None) -> Call:
        """Make a budget again from its copy's values (budget_restore.lua's ARGV after now)."""
        return Call("budget_restore", self.keys.flow, [script_now(now), *values])

    def budget_put(
        self,
        *,
        now: int | None,
        name: str,
        op: str,
        tokens: int,
        win: str,
        win_ms: int,
        parent: str,
        max_tokens: int,
        op_id: str,
        op_id_keep_ms: int,
    ) -> Call:
        k = self.keys
        keys = [*k.flow, k.waiting, k.wake, k.job_prefix, k.events, k.budget_ops_prefix]
        args: list[Any] = [script_now(now), name, op, tokens, win, win_ms, parent]
        args += (self._events_maxlen, max_tokens, op_id, op_id_keep_ms)
        return Call("budget_put", keys, args)

    def reserve(
        self, *, now: int | None, name: str, tokens: int, reservation: str, job_id: str, hold_ms: int
    ) -> Call:
        k = self.keys
        args = [script_now(now), name, tokens, reservation, job_id, hold_ms]
        return Call("reserve", [*k.flow, k.held], args)

    def settle(self, *, now: int | None, reservation: str, how: str, tokens: int) -> Call:
        k = self.keys
        keys = [*k.flow, k.wake, k.events, k.held]
        return Call("settle", keys, [script_now(now), reservation, how, tokens, self._events_maxlen])

    def sweep(self, *, now: int | None, how: str, reservations: Sequence[str] = ()) -> Call:
        """Settle holds: these (refund or unknown), or with none given the expired ones."""
        k = self.keys
        return Call("sweep", [*k.flow, k.held, k.wake], [script_now(now), how, *reservations])
