"""The built-in prices: USD per million tokens (input, cached input, output), per provider and model.

Collected on :data:`PRICES_AS_OF`; where each figure comes from (``page``, ``2025``,
``secondary``) is said above its entries, and what those words mean, with the caveats, in
:mod:`sluice.llm.pricing`. A data table: prices change, and overrides go in
``SLUICE_PRICING_FILE``, not here.
"""

from __future__ import annotations

import dataclasses

from sluice.llm.price_table import Price, PriceTable

__all__ = ["ANTHROPIC_CACHE_WRITE", "BUILTIN_PRICES", "PRICES_AS_OF"]

#: The day the built-in prices were collected (see :mod:`sluice.llm.pricing` for how).
PRICES_AS_OF = "2026-11-30"

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

#: The built-in prices (see :mod:`sluice.llm.pricing` for their date and sources).
BUILTIN_PRICES = PriceTable(
    {
        **{f"openai/{model}": price for model, price in _OPENAI.items()},
        **{f"anthropic/{model}": _with_cache_write(price) for model, price in _ANTHROPIC.items()},
        **{f"gemini/{model}": price for model, price in _GEMINI.items()},
    }
)
