"""What an LLM call cost, and the most it may cost, in US dollars, from a table of prices.

Budgets may be set in money. A job reserves :func:`worst_case_cost` before it
is dispatched (every prompt token at the full input price, ``max_tokens`` at the
output price) and settles at :func:`cost` of the usage the provider reported.
The ledger holds integers, so amounts go in as micro-dollars,
:func:`to_micro_usd`, rounded up.

Prices are USD per million tokens, per provider and model (:class:`Price`, in a
:class:`PriceTable`: :mod:`sluice.llm.price_table`). The built-in table
(:data:`BUILTIN_PRICES`, :mod:`sluice.llm.prices`) was put together on **2026-11-30** from
stored copies of the providers' pricing pages; no live page could be read from
where it was written, and **prices change**, so check the ones you budget with
against the providers' pages (platform.openai.com / developers.openai.com
pricing, platform.claude.com/docs/en/about-claude/pricing,
ai.google.dev/gemini-api/docs/pricing) and override what differs. Each entry
says where its figures come from:

* ``page``: a stored copy of the provider's own pricing or model page;
* ``2025``: the provider's published price as of 2025, not found again on a
  2026 copy of its page (third-party copies from 2026 agree where noted);
* ``secondary``: from third-party pages quoting the provider, not seen on the
  provider's own page: the least certain.

Not modelled: batch, flex and priority tiers, regional-endpoint uplifts, audio
and image input rates, and cache *writes* (Anthropic bills them at 1.25x or 2x
the input price; :class:`~sluice.llm.provider.Usage` does not carry them, so
they are priced as ordinary input here, which understates them).

Overrides: ``SLUICE_PRICING_FILE`` names a JSON file of entries that replace or
add to the built-in ones::

    {"openai/gpt-4o": {"input": 2.5, "cached_input": 1.25, "output": 10},
     "openai/my-finetune": {"input": 0.3, "output": 1.2}}

``cached_input`` defaults to ``input``; an entry may also give
``"long_context_above": 200000`` and ``"long_context": {...}``, the prices of
requests whose prompt is longer than that. A malformed file is a
:class:`~sluice.errors.ConfigurationError` naming the entry and the problem;
it is never skipped, since a wrong price is worse than none. In code:
``BUILTIN_PRICES.with_overrides({...})`` and the ``table=`` argument.

Model names match an entry exactly, or by the longest entry they extend with a
*version suffix* only: a date (``gpt-4o-2024-08-06``, ``claude-3-5-sonnet-20241022``),
a snapshot number (``gpt-4-0613``, ``gemini-1.5-flash-002``), ``-latest``, or a
platform version (``-v2``, ``@20241022``). Any other suffix names a different
model with its own price (``o3-pro`` is not ``o3``, ``gpt-4o-audio-preview`` is
not ``gpt-4o``, ``gemini-2.5-flash-lite`` is not ``gemini-2.5-flash``), so it
has no price (None) until the table or an override gives one, rather than
borrowing a neighbour's, which can be ten times too low.
"""

from __future__ import annotations

import os
import threading
from decimal import ROUND_CEILING, Decimal

from sluice.errors import ConfigurationError
from sluice.llm.price_table import Price, PriceTable
from sluice.llm.prices import BUILTIN_PRICES, PRICES_AS_OF
from sluice.llm.provider import Usage
from sluice.settings import environment

__all__ = [
    "BUILTIN_PRICES",
    "ENV_PRICING_FILE",
    "PRICES_AS_OF",
    "Price",
    "PriceTable",
    "cost",
    "default_table",
    "price_for",
    "to_micro_usd",
    "worst_case_cost",
]

#: The environment variable naming a JSON file of price overrides.
ENV_PRICING_FILE = "SLUICE_PRICING_FILE"

_MILLION = Decimal(1_000_000)

_env_lock = threading.Lock()
# The table of the pricing file last read, keyed by (path, mtime_ns, size).
_env_table: dict[tuple[str, int, int], PriceTable] = {}


def default_table() -> PriceTable:
    """The built-in prices with the overrides of ``SLUICE_PRICING_FILE``, if set.

    The file is read again when it changes (its size or modification time), so editing it takes
    effect without a restart. Call this when a worker starts to find a malformed file then,
    not at the first cost: it raises ConfigurationError (also when the file is missing).
    """
    where = environment().get(ENV_PRICING_FILE, "").strip()
    if not where:
        return BUILTIN_PRICES
    try:
        stat = os.stat(where)
    except OSError as exc:
        raise ConfigurationError(
            f"{ENV_PRICING_FILE}={where}: cannot read it ({exc.strerror}); point it at a JSON file "
            "of price overrides, or unset it to use the built-in prices"
        ) from exc
    key = (where, stat.st_mtime_ns, stat.st_size)
    with _env_lock:
        table = _env_table.get(key)
        if table is None:
            table = BUILTIN_PRICES.with_overrides_from_file(where)
            _env_table.clear()
            _env_table[key] = table
        return table


def price_for(provider: str, model: str, *, table: PriceTable | None = None) -> Price | None:
    """The price of ``model`` at ``provider`` (None: none known), from ``table`` or the default."""
    return (table or default_table()).lookup(provider, model)


def cost(provider: str, model: str, usage: Usage, *, table: PriceTable | None = None) -> float | None:
    """US dollars ``usage`` cost at ``provider``'s price for ``model`` (None: no price known).

    ``(prompt_tokens - cached_tokens) * input + cached_tokens * cached_input + completion_tokens *
    output``, per million, at the long-context prices when the prompt is above the model's
    threshold; computed in decimal and rounded to 1e-8 dollars. ``cached_tokens`` is part of
    ``prompt_tokens``; a provider reporting more cached than prompt tokens is billed for the
    cached ones and no negative rest.
    """
    return (table or default_table()).cost(provider, model, usage)


def worst_case_cost(
    provider: str, model: str, prompt_tokens: int, max_tokens: int, *, table: PriceTable | None = None
) -> float | None:
    """The most a call of at most ``prompt_tokens`` in and ``max_tokens`` out can cost, to reserve
    against a money budget (None: no price known).

    Every prompt token at the higher of the input and cached prices, every output token at the
    output price, and the long-context prices too when the prompt may exceed the threshold;
    rounded *up* to 1e-8 dollars, so that :func:`cost` of any usage within the bounds is never
    more. ``prompt_tokens`` is an upper bound such as :func:`sluice.llm.tokens.count_prompt_tokens`.
    """
    return (table or default_table()).worst_case_cost(provider, model, prompt_tokens, max_tokens)


def to_micro_usd(dollars: float | Decimal | int) -> int:
    """``dollars`` as whole micro-dollars for the integer ledger, rounded *up* (a reservation or a
    charge is never understated by the conversion). ``to_micro_usd(0.0000011) == 2``."""
    if isinstance(dollars, bool) or not isinstance(dollars, int | float | Decimal):
        raise TypeError(f"dollars must be a number, got {type(dollars).__name__}")
    amount = dollars if isinstance(dollars, Decimal) else Decimal(repr(dollars))
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"dollars must be a finite amount >= 0, got {dollars!r}")
    return int((amount * _MILLION).to_integral_value(rounding=ROUND_CEILING))
