"""A table of LLM prices: :class:`Price` (US dollars per million tokens) and :class:`PriceTable`
(prices by ``"provider/model"``, with the lookup of a model's entry and overrides).

How model names find their entry, and the format of an override file, are in
:mod:`sluice.llm.pricing`; the built-in prices are :mod:`sluice.llm.prices`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal
from pathlib import Path

from sluice.errors import ConfigurationError
from sluice.llm.provider import Usage

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


class PriceTable(Mapping[str, Price]):
    """Prices keyed by ``"provider/model"`` (lowercase; the model part may itself contain "/").

    A read-only mapping; :meth:`lookup` finds the entry for a model as the provider names it
    (see :mod:`sluice.llm.pricing` for how names match), :meth:`with_overrides` makes a new table.
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
        """See :func:`sluice.llm.pricing.cost`."""
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
        """See :func:`sluice.llm.pricing.worst_case_cost`."""
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
