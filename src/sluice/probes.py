"""Where the engine and the LLM layer say what they did, for whoever listens.

The engine may import no metrics library, and the LLM layer may not import the service,
yet ``sluice worker --metrics-port`` exports what both do in a worker process: busy slots,
handler durations, provider calls, tokens, cost, cache lookups. So they report to the
:class:`Probe` installed here, which does nothing unless the command line installs one
that counts (``sluice.service.worker_metrics``). A call costs one attribute lookup and one
method call when nothing listens.

A probe must not raise and must not block: it runs on the worker's event loop, inside the
code it watches.
"""

from __future__ import annotations

#: Outcomes of a provider call (``provider_call``).
PROVIDER_OUTCOMES = ("ok", "throttled", "unavailable", "rejected", "error")
#: Results of a semantic-cache lookup (``cache_lookup``).
CACHE_RESULTS = ("exact_hit", "semantic_hit", "miss", "bypass")
#: Kinds of tokens (``tokens``).
TOKEN_KINDS = ("prompt", "completion", "cached")


class Probe:
    """Listens to nothing: the default. Subclass it and :func:`install` the instance."""

    def attempt_started(self, job_type: str) -> None:
        """A handler got a slot."""

    def attempt_ended(self, job_type: str, outcome: str, seconds: float) -> None:
        """The attempt that :meth:`attempt_started` announced gave back its slot."""

    def provider_call(self, provider: str, model: str, outcome: str) -> None:
        """One call to an LLM provider ended; ``outcome`` is one of :data:`PROVIDER_OUTCOMES`."""

    def tokens(self, provider: str, model: str, kind: str, count: int) -> None:
        """Tokens a provider reported for one answer, by kind (:data:`TOKEN_KINDS`)."""

    def cost(self, provider: str, model: str, usd: float) -> None:
        """What one answer cost, in US dollars (the pricing table's figure)."""

    def cache_lookup(self, result: str) -> None:
        """One llm-inference request met the semantic cache: :data:`CACHE_RESULTS`."""


_NOTHING = Probe()
_current: Probe = _NOTHING


def probe() -> Probe:
    """The installed probe (a :class:`Probe` that does nothing when none was)."""
    return _current


def install(listener: Probe | None) -> None:
    """Make ``listener`` the process's probe; None puts back the one that does nothing."""
    global _current  # noqa: PLW0603 - one per process, by design: the worker's metrics
    _current = listener if listener is not None else _NOTHING
