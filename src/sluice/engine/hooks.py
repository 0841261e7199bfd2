"""A worker's extension points: startup, shutdown, and around each attempt.

A :class:`Hook` is a class of no-op methods; override those you need and
pass instances to ``Worker(hooks=[...])`` (or :meth:`Worker.add_hook`).
``startup`` and ``shutdown`` get the worker's ``state`` dict, where a hook
keeps what lives as long as the worker (a client, a model), instead of a
module global a second worker would share. ``before_attempt`` runs on the
attempt's own task just before its handler (so a span it opens is the
handler's parent), and what it returns is handed to ``after_attempt``.

As in dramatiq's middleware, "before" hooks run in order and "after" ones
in reverse; a hook that raises is logged and never fails the attempt or
stops the others. A worker with no hooks pays nothing per job for them.

Every before_attempt is followed by exactly one after_attempt of the same
hook, on the same task, so what a hook opens (a span, a busy slot, a context
variable) it can always close. An attempt stopped before its task first ran
(a shutdown, a cancel request or a lost lease in the loop turn it was
leased) calls neither: nothing of it ran, and its job is reported as before.
The worker's attempt spans (``sluice.tracing.AttemptSpans``) and metrics
(``sluice.service.worker_metrics.WorkerMetrics``) are hooks of this kind.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from sluice.engine.context import JobContext

log = logging.getLogger("sluice.worker")


class AttemptEnd(NamedTuple):
    """How an attempt ended, as hooks see it."""

    #: completed, retry, dead, throttled, cancelled, released or lease_lost
    outcome: str
    #: the error text the job record keeps (bounded), for a failure
    error: str | None
    #: seconds from the attempt's start to its end
    seconds: float
    #: its timeout fired (then a retry or dead outcome is the timeout's)
    timed_out: bool = False
    #: the worker has a handler for the job's name; False: any string a producer sent,
    #: dead-lettered unrun (so a metric label must not take ``job.name`` as it is)
    registered: bool = True


class Hook:
    """Does nothing at every point: subclass it."""

    async def startup(self, state: dict[str, Any]) -> None:
        """Before the worker takes its first job."""

    async def shutdown(self, state: dict[str, Any]) -> None:
        """After its last attempt ended (also when startup or the run failed)."""

    def before_attempt(self, job: JobContext) -> Any:
        """Just before the handler runs, on the attempt's task; returns what after_attempt gets."""
        return None

    def after_attempt(self, job: JobContext, end: AttemptEnd, before: Any) -> None:
        """Once the attempt's outcome is known (``before``: what before_attempt returned)."""


class FreezeAfterStartup(Hook):
    """Moves what start-up made out of the garbage collector's way, once every hook started.

    Modules, clients and models live as long as the process, yet each full collection
    walks them all: a pause of tens of ms on the event loop, which delays every call in
    flight and bunches paced calls up at the provider. ``gc.freeze()`` leaves them out of
    later collections. It acts on the whole process, so ``sluice worker`` adds it (last,
    after the other hooks' startup) and a program of your own decides for itself.
    """

    async def startup(self, state: dict[str, Any]) -> None:
        gc.freeze()


def around_attempts(hooks: Sequence[Hook]) -> tuple[Hook, ...]:
    """The hooks that do something around an attempt (override before_attempt or
    after_attempt): the others are left out of every attempt, which then pays nothing
    for them."""
    return tuple(
        hook
        for hook in hooks
        if type(hook).before_attempt is not Hook.before_attempt
        or type(hook).after_attempt is not Hook.after_attempt
    )


def before_attempt(hooks: Sequence[Hook], job: JobContext) -> list[Any]:
    """Run every hook's before_attempt, in order; returns what each returned."""
    got: list[Any] = []
    for hook in hooks:
        try:
            got.append(hook.before_attempt(job))
        except Exception:
            log.exception("worker: hook %r failed before job %s", hook, job.id)
            got.append(None)
    return got


def after_attempt(hooks: Sequence[Hook], job: JobContext, end: AttemptEnd, got: list[Any]) -> None:
    """Run every hook's after_attempt, in reverse order."""
    for hook, before in zip(reversed(hooks), reversed(got), strict=True):
        try:
            hook.after_attempt(job, end, before)
        except Exception:
            log.exception("worker: hook %r failed after job %s", hook, job.id)


async def startup(hooks: Sequence[Hook], state: dict[str, Any]) -> None:
    """Run the startup hooks in order. One that raises ends the start (a worker that cannot
    start must not take jobs): those started before it are shut down, and the error raised."""
    for started, hook in enumerate(hooks):
        try:
            await hook.startup(state)
        except BaseException:
            await shutdown(hooks[:started], state)
            raise


async def shutdown(hooks: Sequence[Hook], state: dict[str, Any]) -> None:
    """Run the shutdown hooks in reverse; one that raises is logged, and the others run."""
    for hook in reversed(hooks):
        try:
            await hook.shutdown(state)
        except Exception:
            log.exception("worker: hook %r failed at shutdown", hook)
