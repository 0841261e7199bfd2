"""Where the LLM layer says what it did, for whoever listens: the running attempt's probe.

The LLM layer may not import the service, yet ``sluice worker --metrics-port`` exports what
it does in a worker: provider calls, tokens, cost, cache lookups. So it reports to
:func:`probe`, the :class:`Probe` a worker hook attached for the attempt
(``sluice.service.worker_metrics.WorkerMetrics``, on the attempt's own task). It is held in
a context variable, not a process global: it reaches the handler, the tasks it starts and
a sync handler's thread (each gets a copy of the attempt's context), and each worker's
attempts report to that worker's hook, not to whatever was installed last. Elsewhere (no
attempt, or a worker without such a hook) the probe does nothing, and a call costs one
context-variable read and one method call.

A probe must not raise and must not block: it runs inside the code it watches, on the
event loop or in a sync handler's thread.
"""

from __future__ import annotations

from contextvars import ContextVar, Token

#: Outcomes of a provider call (``provider_call``).
PROVIDER_OUTCOMES = ("ok", "throttled", "unavailable", "rejected", "error")
#: Results of a semantic-cache lookup (``cache_lookup``).
CACHE_RESULTS = ("exact_hit", "semantic_hit", "miss", "bypass")
#: Kinds of tokens (``tokens``).
TOKEN_KINDS = ("prompt", "completion", "cached")


class Probe:
    """Listens to nothing: the default. Subclass it and :func:`attach` the instance."""

    def provider_call(self, provider: str, model: str, outcome: str) -> None:
        """One call to an LLM provider ended; ``outcome`` is one of :data:`PROVIDER_OUTCOMES`."""

    def tokens(self, provider: str, model: str, kind: str, count: int) -> None:
        """Tokens a provider reported for one answer, by kind (:data:`TOKEN_KINDS`)."""

    def cost(self, provider: str, model: str, usd: float) -> None:
        """What one answer cost, in US dollars (the pricing table's figure)."""

    def cache_lookup(self, result: str) -> None:
        """One llm-inference request met the semantic cache: :data:`CACHE_RESULTS`."""


_NOTHING = Probe()
_attached: ContextVar[Probe] = ContextVar("sluice.probe", default=_NOTHING)


def probe() -> Probe:
    """The probe attached in this context (a :class:`Probe` that does nothing when none was)."""
    return _attached.get()


def attach(listener: Probe) -> Token[Probe]:
    """Make ``listener`` the probe of this context (an attempt's task, and what it starts)
    until :func:`detach` is given the token, in the same context."""
    return _attached.set(listener)


def detach(token: Token[Probe]) -> None:
    """Put back the probe that was attached before ``token``'s."""
    _attached.reset(token)
