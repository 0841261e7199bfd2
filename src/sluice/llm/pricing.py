"""What an LLM call cost, and the most it may cost, in US dollars, from a table of prices.

Budgets may be set in money. A job reserves :func:`worst_case_cost` before it
is dispatched (every prompt token at the full input price, ``max_tokens`` at the
output price) and settles at :func:`cost` of the usage the provider reported.
The ledger holds integers, so amounts go in as micro-dollars,
:func:`to_micro_usd`, rounded up.

Prices are USD per million tokens, per provider and model (:class:`Price`). The
built-in table (:data:`BUILTIN_PRICES`) was put together on **2026-11-30** from
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

import dataclasses
import json
import math
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal
from pathlib import Path

from sluice.errors import ConfigurationError
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
#: The day the built-in prices were collected (see the module's docstring for how).
PRICES_AS_OF = "2026-11-30"

_MILLION = Decimal(1_000_000)
_QUANTUM = Decimal("1e-8")
_FIELDS = ("input", "cached_input", "output", "cache_write", "long_context_above", "long_context")
_EXAMPLE = '{"input": 2.5, "cached_input": 1.25, "output": 10}'
# What may follow a table entry's name in a model's name and still be the same model.
_VERSION_SUFFIX = re.compile(r"(?:-\d{4}-\d{2}-\d{2}|-\d{8}|-\d{3,4}|-latest|-v\d+(?::\d+)?|@\d{8}|@latest)+")


@dataclass(frozen=True, slots=True)
class Price:
    """US dollars per million tokens: uncached ``input``, ``cached_input`` (prompt tokens served
    from the provider's cache) and ``output`` (reasoning tokens included).

    A request whose prompt (cached tokens included) is longer than ``long_context_above``
    tokens is billed entirely at ``long_context`` (Gemini 1.5 above 128 K, Gemini 2.5 Pro and
    Claude Sonnet 4/4.5 above 200 K, GPT-5.4 above 272 K).
    """

    input: float
    cached_input: float
    output: float
    long_context_above: int | None = None
    long_context: Price | None = None
    #: prompt tokens written to the provider's cache (None: at ``input``); Anthropic bills a
    #: five-minute cache write at 1.25 times the input price
    cache_write: float | None = None

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output", "cache_write"):
            value = getattr(self, name)
            if name == "cache_write" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a number of US dollars per million tokens, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if (self.long_context_above is None) != (self.long_context is None):
            raise ValueError("long_context_above and long_context go together: give both or neither")
        if self.long_context_above is not None:
            above = self.long_context_above
            if isinstance(above, bool) or not isinstance(above, int) or above < 1:
                raise ValueError(f"long_context_above must be a number of tokens >= 1, got {above!r}")
        if self.long_context is not None and self.long_context.long_context is not None:
            raise ValueError("long_context prices cannot have a long_context of their own")

    @property
    def write_price(self) -> float:
        """The price of a prompt token written to the cache."""
        return self.input if self.cache_write is None else self.cache_write

    def tier(self, prompt_tokens: int) -> Price:
        """The prices that apply to a request with ``prompt_tokens`` input tokens."""
        above = self.long_context_above
        if self.long_context is not None and above is not None and prompt_tokens > above:
            return self.long_context
        return self


#: Anthropic bills a prompt-cache write (five-minute cache) at this times the input price.
ANTHROPIC_CACHE_WRITE = 1.25


def _with_cache_write(price: Price) -> Price:
    long = _with_cache_write(price.long_context) if price.long_context is not None else None
    return dataclasses.replace(
        price, cache_write=round(price.input * ANTHROPIC_CACHE_WRITE, 6), long_context=long
    )


def _price(
    input: float, cached_input: float, output: float, *, above: int | None = None, long: Price | None = None
) -> Price:
    return Price(input, cached_input, output, long_context_above=above, long_context=long)


class PriceTable(Mapping[str, Price]):
    """Prices keyed by ``"provider/model"`` (lowercase; the model part may itself contain "/").

    A read-only mapping; :meth:`lookup` finds the entry for a model as the provider names it
    (see the module's docstring for how names match), :meth:`with_overrides` makes a new table.
    """

    __slots__ = ("_by_provider", "_prices")

    def __init__(self, prices: Mapping[str, Price]) -> None:
        table: dict[str, Price] = {}
        for key, price in prices.items():
            provider, model = _split_key(key)
            if not isinstance(price, Price):
                raise TypeError(f"price of {key!r} must be a Price, got {type(price).__name__}")
            table[f"{provider}/{model}"] = price
        self._prices = table
        by_provider: dict[str, list[tuple[str, Price]]] = {}
        for key, price in table.items():
            provider, model = key.split("/", 1)
            by_provider.setdefault(provider, []).append((model, price))
        for models in by_provider.values():
            models.sort(key=lambda item: len(item[0]), reverse=True)
        self._by_provider = by_provider

    def __getitem__(self, key: str) -> Price:
        return self._prices[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._prices)

    def __len__(self) -> int:
        return len(self._prices)

    def __repr__(self) -> str:
        return f"PriceTable({len(self)} prices)"

    def lookup(self, provider: str, model: str) -> Price | None:
        """The price of ``model`` at ``provider``, or None when the table has none."""
        provider = provider.strip().lower()
        name = model.strip().lower().removeprefix("models/").removeprefix(f"{provider}/")
        price = self._prices.get(f"{provider}/{name}")
        if price is not None:
            return price
        for known, candidate in self._by_provider.get(provider, ()):
            if name.startswith(known) and _VERSION_SUFFIX.fullmatch(name, len(known)):
                return candidate
        return None

    def with_overrides(self, overrides: Mapping[str, Price | Mapping[str, object]]) -> PriceTable:
        """A new table: this one with ``overrides`` replacing or adding entries. A value is a
        :class:`Price` or a mapping as in the pricing file (``{"input": ..., "output": ...}``);
        a malformed one is a ValueError naming the entry."""
        prices = dict(self._prices)
        for key, value in overrides.items():
            try:
                provider, model = _split_key(key)
                prices[f"{provider}/{model}"] = value if isinstance(value, Price) else _parse_price(value)
            except _EntryError as exc:
                raise ValueError(f"price override {key!r}: {exc}. An entry looks like {_EXAMPLE}") from None
        return PriceTable(prices)

    def with_overrides_from_file(self, path: str | os.PathLike[str]) -> PriceTable:
        """A new table: this one with the entries of the JSON file at ``path`` (the format of
        ``SLUICE_PRICING_FILE``). Raises ConfigurationError naming the entry and what is wrong."""
        where = os.fspath(path)
        try:
            text = Path(where).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"pricing file {where}: cannot read it ({exc})") from exc
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except _EntryError as exc:
            raise ConfigurationError(f"pricing file {where}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigurationError(
                f"pricing file {where}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
            ) from None
        if not isinstance(data, dict):
            raise ConfigurationError(
                f'pricing file {where}: must be a JSON object of "provider/model": prices, like '
                f'{{"openai/gpt-4o": {_EXAMPLE}}}, got {type(data).__name__}'
            )
        prices = dict(self._prices)
        for key, value in data.items():
            try:
                provider, model = _split_key(key)
                prices[f"{provider}/{model}"] = _parse_price(value)
            except _EntryError as exc:
                raise ConfigurationError(
                    f"pricing file {where}: entry {key!r}: {exc}. An entry looks like "
                    f"{_EXAMPLE} (US dollars per million tokens)"
                ) from None
        return PriceTable(prices)

    def cost(self, provider: str, model: str, usage: Usage) -> float | None:
        """See :func:`cost`."""
        price = self.lookup(provider, model)
        if price is None:
            return None
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            _check_tokens(name, getattr(usage, name))
        tier = price.tier(usage.prompt_tokens)
        written = min(usage.cache_write_tokens, max(usage.prompt_tokens - usage.cached_tokens, 0))
        uncached = max(usage.prompt_tokens - usage.cached_tokens - written, 0)
        total = (
            uncached * _dec(tier.input)
            + usage.cached_tokens * _dec(tier.cached_input)
            + written * _dec(tier.write_price)
            + usage.completion_tokens * _dec(tier.output)
        )
        return float((total / _MILLION).quantize(_QUANTUM, rounding=ROUND_HALF_EVEN))

    def worst_case_cost(self, provider: str, model: str, prompt_tokens: int, max_tokens: int) -> float | None:
        """See :func:`worst_case_cost`."""
        _check_tokens("prompt_tokens", prompt_tokens)
        _check_tokens("max_tokens", max_tokens)
        price = self.lookup(provider, model)
        if price is None:
            return None
        # A prompt of at most prompt_tokens may fall in either tier once it is above the threshold.
        tiers = {price, price.tier(prompt_tokens)}
        worst = max(
            prompt_tokens * max(_dec(t.input), _dec(t.cached_input), _dec(t.write_price))
            + max_tokens * _dec(t.output)
            for t in tiers
        )
        return float((worst / _MILLION).quantize(_QUANTUM, rounding=ROUND_CEILING))


class _EntryError(ValueError):
    """What is wrong with one entry (the caller adds where it is)."""


def _split_key(key: object) -> tuple[str, str]:
    if not isinstance(key, str):
        raise _EntryError(f"the key must be a string, got {type(key).__name__}")
    provider, slash, model = key.strip().lower().partition("/")
    if not slash or not provider or not model.strip("/"):
        raise _EntryError('the key must be "provider/model", like "openai/gpt-4o"')
    return provider, model


def _parse_price(value: object, *, nested: bool = False) -> Price:
    if not isinstance(value, Mapping):
        raise _EntryError(f"the prices must be an object, got {type(value).__name__}")
    allowed = _FIELDS[:4] if nested else _FIELDS
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise _EntryError(f"unknown field {unknown[0]!r} (the fields are {', '.join(allowed)})")
    missing = [k for k in ("input", "output") if k not in value]
    if missing:
        raise _EntryError(f"{missing[0]!r} is missing")
    rates: dict[str, float] = {}
    for name in ("input", "cached_input", "output"):
        rate = value.get(name, value["input"])
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate < 0:
            raise _EntryError(
                f"{name!r} must be a number >= 0 of US dollars per million tokens, got {rate!r}"
            )
        rates[name] = float(rate)
    write = value.get("cache_write")
    if write is not None:
        if (
            isinstance(write, bool)
            or not isinstance(write, int | float)
            or not math.isfinite(write)
            or write < 0
        ):
            raise _EntryError(
                f"'cache_write' must be a number >= 0 of US dollars per million tokens, got {write!r}"
            )
        rates["cache_write"] = float(write)
    long_context = None
    above = value.get("long_context_above")
    if "long_context" in value:
        try:
            long_context = _parse_price(value["long_context"], nested=True)
        except _EntryError as exc:
            raise _EntryError(f"long_context: {exc}") from None
    try:
        return Price(**rates, long_context_above=above, long_context=long_context)
    except ValueError as exc:
        raise _EntryError(str(exc)) from None


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise _EntryError(f"entry {key!r} appears twice")
        seen[key] = value
    return seen


def _dec(value: float) -> Decimal:
    # repr is the shortest decimal that reads back as the float: 2.5 -> Decimal("2.5"), 0.075 ->
    # Decimal("0.075"), not the binary expansion 0.07499999999999999722...
    return Decimal(repr(value))


def _check_tokens(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


# ---- the built-in prices (USD per million tokens: input, cached input, output) -------------------

_OPENAI = {
    # 2025; 2026 third-party copies agree
    "gpt-4o": _price(2.50, 1.25, 10.00),
    "gpt-4o-mini": _price(0.15, 0.075, 0.60),
    "text-embedding-3-small": _price(0.02, 0.02, 0.0),
    "text-embedding-3-large": _price(0.13, 0.13, 0.0),
    "gpt-4.1": _price(2.00, 0.50, 8.00),
    "gpt-4.1-mini": _price(0.40, 0.10, 1.60),
    # 2025
    "gpt-4o-2024-05-13": _price(5.00, 5.00, 15.00),  # the first gpt-4o snapshot, never cut
    "chatgpt-4o-latest": _price(5.00, 5.00, 15.00),
    "gpt-4.1-nano": _price(0.10, 0.025, 0.40),
    "gpt-4-turbo": _price(10.00, 10.00, 30.00),
    "gpt-4": _price(30.00, 30.00, 60.00),
    "gpt-3.5-turbo": _price(0.50, 0.50, 1.50),
    "o1": _price(15.00, 7.50, 60.00),
    "o1-mini": _price(1.10, 0.55, 4.40),
    "o3": _price(2.00, 0.50, 8.00),  # after OpenAI's June 2025 cut from 10 / 40
    "o3-mini": _price(1.10, 0.55, 4.40),
    "o3-pro": _price(20.00, 20.00, 80.00),
    "o4-mini": _price(1.10, 0.275, 4.40),
    "gpt-5": _price(1.25, 0.125, 10.00),
    "gpt-5-mini": _price(0.25, 0.025, 2.00),
    "gpt-5-nano": _price(0.05, 0.005, 0.40),
    "gpt-5-pro": _price(15.00, 15.00, 120.00),
    "text-embedding-ada-002": _price(0.10, 0.10, 0.0),
    # secondary
    "gpt-5.1": _price(1.25, 0.125, 10.00),
    "gpt-5.4-mini": _price(0.75, 0.075, 4.50),
    "gpt-5.4-nano": _price(0.20, 0.02, 1.25),
    # page (developers.openai.com model pages, 2026): 2x input and 1.5x output above 272 K
    "gpt-5.2": _price(1.75, 0.175, 14.00),
    "gpt-5.4": _price(2.50, 0.25, 15.00, above=272_000, long=_price(5.00, 0.50, 22.50)),
    # secondary; the long-context tier is assumed to be GPT-5.4's rule (unverified)
    "gpt-5.5": _price(5.00, 0.50, 30.00, above=272_000, long=_price(10.00, 1.00, 45.00)),
}

_SONNET = _price(3.00, 0.30, 15.00)
# Sonnet 4 and 4.5 with the 1M-context beta: the whole request at 6 / 22.50 above 200 K input tokens.
_SONNET_LONG = _price(3.00, 0.30, 15.00, above=200_000, long=_price(6.00, 0.60, 22.50))
_OPUS_OLD = _price(15.00, 1.50, 75.00)
_OPUS_NEW = _price(5.00, 0.50, 25.00)

_ANTHROPIC = {
    # page (Anthropic's pricing page: copies of mid-2025, 2025-11 and 2026); cached = cache hits
    "claude-3-haiku": _price(0.25, 0.03, 1.25),
    "claude-3-opus": _OPUS_OLD,
    "claude-3-5-haiku": _price(0.80, 0.08, 4.00),
    "claude-3-5-sonnet": _SONNET,
    "claude-3-7-sonnet": _SONNET,
    "claude-sonnet-4": _SONNET_LONG,
    "claude-sonnet-4-0": _SONNET_LONG,
    "claude-sonnet-4-5": _SONNET_LONG,
    "claude-haiku-4-5": _price(1.00, 0.10, 5.00),
    "claude-opus-4": _OPUS_OLD,
    "claude-opus-4-0": _OPUS_OLD,
    "claude-opus-4-1": _OPUS_OLD,
    "claude-opus-4-5": _OPUS_NEW,
    "claude-opus-4-6": _OPUS_NEW,
    "claude-opus-4-7": _OPUS_NEW,
    "claude-opus-4-8": _OPUS_NEW,
    "claude-opus-5": _OPUS_NEW,
    "claude-sonnet-5": _price(2.00, 0.20, 10.00),
    # page for input and output; cache hits secondary (cut to 0.05x input in October 2026)
    "claude-sonnet-5-5": _price(2.00, 0.10, 10.00),
    "claude-opus-5-5": _price(4.00, 0.20, 20.00),
    # secondary: Sonnet 4.6 dropped the long-context surcharge; Haiku 5.5 has one above 100 K
    "claude-sonnet-4-6": _SONNET,
    "claude-haiku-5-5": _price(0.10, 0.01, 0.50, above=100_000, long=_price(0.50, 0.05, 2.50)),
}

_GEMINI = {
    # 2025 (retired in 2025; their last published prices), the whole request at the higher
    # price above 128 K prompt tokens
    "gemini-1.5-flash": _price(0.075, 0.01875, 0.30, above=128_000, long=_price(0.15, 0.0375, 0.60)),
    "gemini-1.5-flash-8b": _price(0.0375, 0.01, 0.15, above=128_000, long=_price(0.075, 0.02, 0.30)),
    "gemini-1.5-pro": _price(1.25, 0.3125, 5.00, above=128_000, long=_price(2.50, 0.625, 10.00)),
    # 2025; 2026 third-party copies agree (text, image and video input; audio costs more)
    "gemini-2.0-flash": _price(0.10, 0.025, 0.40),
    "gemini-2.0-flash-lite": _price(0.075, 0.075, 0.30),
    # secondary (input and output agree across 2026 copies; context-cache prices were cut in late
    # 2025 from 0.31 / 0.075 / 0.025 and are the least certain figures here)
    "gemini-2.5-pro": _price(1.25, 0.125, 10.00, above=200_000, long=_price(2.50, 0.25, 15.00)),
    "gemini-2.5-flash": _price(0.30, 0.03, 2.50),
    "gemini-2.5-flash-lite": _price(0.10, 0.01, 0.40),
    # 2025: text-embedding-004 was free of charge on the Gemini API (Vertex AI bills it per
    # character, not modelled); uncertain, and the model is being retired
    "text-embedding-004": _price(0.0, 0.0, 0.0),
    "gemini-embedding-001": _price(0.15, 0.15, 0.0),
}

#: The built-in prices (see the module's docstring for their date and sources).
BUILTIN_PRICES = PriceTable(
    {
        **{f"openai/{model}": price for model, price in _OPENAI.items()},
        **{f"anthropic/{model}": _with_cache_write(price) for model, price in _ANTHROPIC.items()},
        **{f"gemini/{model}": price for model, price in _GEMINI.items()},
    }
)

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
