"""Prices: which entry a model name gets, what a usage cost, the most a call may cost, overrides."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import hypothesis
import pytest
from hypothesis import strategies as st

from sluice.errors import ConfigurationError
from sluice.llm import pricing
from sluice.llm.pricing import (
    BUILTIN_PRICES,
    ENV_PRICING_FILE,
    Price,
    PriceTable,
    cost,
    price_for,
    to_micro_usd,
    worst_case_cost,
)
from sluice.llm.provider import Usage


@pytest.fixture(autouse=True)
def _no_pricing_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_PRICING_FILE, raising=False)


def write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


# ---- which entry a model gets ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("provider", "model", "entry"),
    [
        ("openai", "gpt-4o", "openai/gpt-4o"),
        ("openai", "gpt-4o-2024-08-06", "openai/gpt-4o"),
        ("openai", "gpt-4o-2024-05-13", "openai/gpt-4o-2024-05-13"),  # its own, older price
        ("openai", "gpt-4o-mini-2024-07-18", "openai/gpt-4o-mini"),  # the longest entry wins
        ("openai", "gpt-4.1-nano-2025-04-14", "openai/gpt-4.1-nano"),
        ("openai", "o3-2025-04-16", "openai/o3"),
        ("openai", "o3-pro-2025-06-10", "openai/o3-pro"),
        ("openai", "o4-mini", "openai/o4-mini"),
        ("openai", "gpt-5-mini-2025-08-07", "openai/gpt-5-mini"),
        ("openai", "gpt-4-0613", "openai/gpt-4"),
        ("openai", "gpt-3.5-turbo-0125", "openai/gpt-3.5-turbo"),
        ("openai", "chatgpt-4o-latest", "openai/chatgpt-4o-latest"),
        ("openai", "text-embedding-3-large", "openai/text-embedding-3-large"),
        ("OpenAI", " GPT-4o ", "openai/gpt-4o"),
        ("openai", "openai/gpt-4o", "openai/gpt-4o"),
        ("anthropic", "claude-3-5-sonnet-20241022", "anthropic/claude-3-5-sonnet"),
        ("anthropic", "claude-3-5-sonnet-latest", "anthropic/claude-3-5-sonnet"),
        ("anthropic", "claude-3-5-sonnet-v2@20241022", "anthropic/claude-3-5-sonnet"),
        ("anthropic", "claude-3-7-sonnet-20250219", "anthropic/claude-3-7-sonnet"),
        ("anthropic", "claude-3-5-haiku-20241022", "anthropic/claude-3-5-haiku"),
        ("anthropic", "claude-sonnet-4-20250514", "anthropic/claude-sonnet-4"),
        ("anthropic", "claude-sonnet-4-5-20250929", "anthropic/claude-sonnet-4-5"),
        ("anthropic", "claude-opus-4-1-20250805", "anthropic/claude-opus-4-1"),
        ("anthropic", "claude-opus-4-5-20251101", "anthropic/claude-opus-4-5"),
        ("anthropic", "claude-haiku-4-5-20251001", "anthropic/claude-haiku-4-5"),
        ("gemini", "gemini-2.5-flash", "gemini/gemini-2.5-flash"),
        ("gemini", "models/gemini-2.5-pro", "gemini/gemini-2.5-pro"),
        ("gemini", "gemini-1.5-flash-002", "gemini/gemini-1.5-flash"),
        ("gemini", "gemini-1.5-flash-8b-001", "gemini/gemini-1.5-flash-8b"),
        ("gemini", "gemini-2.0-flash-lite-001", "gemini/gemini-2.0-flash-lite"),
        ("gemini", "text-embedding-004", "gemini/text-embedding-004"),
    ],
)
def test_a_model_gets_its_entry_or_the_longest_it_extends_with_a_version(
    provider: str, model: str, entry: str
) -> None:
    assert BUILTIN_PRICES.lookup(provider, model) is BUILTIN_PRICES[entry]


@pytest.mark.parametrize(
    ("provider", "model"),
    [
        ("openai", "gpt-4o-audio-preview"),  # another model: no borrowing gpt-4o's price
        ("openai", "gpt-4o-mini-search-preview"),
        ("openai", "o3-deep-research"),
        ("openai", "ft:gpt-4o-mini-2024-07-18:acme::x1"),  # fine-tunes cost more
        ("openai", "gpt-4.1-turbo"),
        ("anthropic", "claude-opus-4-9"),  # not opus-4 with a version
        ("gemini", "gemini-2.5-flash-preview-09-2025"),
        ("gemini", "gemini-2.5-flash-image"),
        ("ollama", "llama3.1:8b"),
        ("simulated", "gpt-4o"),  # prices are per provider
        ("openai", "claude-3-5-sonnet"),
    ],
)
def test_unknown_models_have_no_price(provider: str, model: str) -> None:
    assert BUILTIN_PRICES.lookup(provider, model) is None
    assert cost(provider, model, Usage(100, 100)) is None
    assert worst_case_cost(provider, model, 100, 100) is None
    assert price_for(provider, model) is None


def test_the_table_is_a_read_only_mapping_of_lowercase_keys() -> None:
    table = PriceTable({"OpenAI/My-Model": Price(1, 1, 2)})
    assert list(table) == ["openai/my-model"]
    assert len(table) == 1 and "openai/my-model" in table
    assert table.lookup("openai", "MY-MODEL-2025-01-01") == Price(1, 1, 2)
    with pytest.raises(TypeError):
        table["openai/x"] = Price(1, 1, 1)  # type: ignore[index]


def test_builtin_prices_are_sane() -> None:
    assert len(BUILTIN_PRICES) >= 50
    for key, price in BUILTIN_PRICES.items():
        assert key.split("/", 1)[0] in {"openai", "anthropic", "gemini"}
        assert price.cached_input <= price.input, key
        if price.long_context is not None:
            long = price.long_context
            assert long.input >= price.input and long.output >= price.output, key
    assert pricing.PRICES_AS_OF in (pricing.__doc__ or "").replace("**", "")


# ---- what a usage cost ------------------------------------------------------------------------


def test_cost_bills_cached_tokens_at_the_cached_price() -> None:
    # gpt-4o: 2.50 in, 1.25 cached, 10 out: (800 * 2.5 + 200 * 1.25 + 500 * 10) / 1e6
    assert cost("openai", "gpt-4o-2024-08-06", Usage(1000, 500, 200)) == 0.00725
    assert cost("openai", "gpt-4o", Usage(1000, 500, 0)) == 0.0075
    assert cost("openai", "gpt-4o", Usage(0, 0, 0)) == 0.0
    # Claude's cache hits: 0.30 for Sonnet
    assert cost("anthropic", "claude-3-7-sonnet-20250219", Usage(10_000, 0, 10_000)) == 0.003


def test_cost_is_decimal_exact_and_rounded_to_1e_8() -> None:
    # 3 cached tokens at 0.075 $/M is 2.25e-7 exactly (floats: 2.2499999999999998e-07); half-even
    assert cost("openai", "gpt-4o-mini", Usage(3, 0, 3)) == 2.2e-07
    assert cost("openai", "gpt-4o-mini", Usage(7, 0, 7)) == 5.2e-07  # 5.25e-7
    table = PriceTable({"x/m": Price(0.1, 0.1, 0.2)})
    assert table.cost("x", "m", Usage(1, 0, 0)) == 1e-07
    assert table.cost("x", "m", Usage(3, 3, 0)) == 9e-07  # 3 * 0.1 + 3 * 0.2, not 9.000000000000001e-07
    # 7 tokens at 0.000123 $/M = 8.61e-10: below the rounding step
    assert PriceTable({"x/m": Price(0.000123, 0.0, 0.0)}).cost("x", "m", Usage(7)) == 0.0


def test_more_cached_than_prompt_tokens_bills_the_cached_ones_and_nothing_negative() -> None:
    assert cost("openai", "gpt-4o", Usage(100, 0, 400)) == 400 * 1.25 / 1e6


def test_negative_usage_is_refused() -> None:
    with pytest.raises(ValueError, match="completion_tokens"):
        cost("openai", "gpt-4o", Usage(10, -1))


def test_long_prompts_are_billed_at_the_long_context_prices() -> None:
    short = cost("gemini", "gemini-2.5-pro", Usage(200_000, 1000))
    long = cost("gemini", "gemini-2.5-pro", Usage(200_001, 1000))
    assert short == (200_000 * 1.25 + 1000 * 10) / 1e6
    assert long == pytest.approx((200_001 * 2.50 + 1000 * 15) / 1e6, abs=1e-8)
    # the threshold counts cached tokens too, and the cached price doubles with the rest
    cached = cost("anthropic", "claude-sonnet-4-5", Usage(250_000, 0, 250_000))
    assert cached == 250_000 * 0.60 / 1e6


# ---- the most a call may cost -----------------------------------------------------------------


def test_worst_case_prices_every_prompt_token_as_uncached_input() -> None:
    assert worst_case_cost("openai", "gpt-4o", 1000, 500) == (1000 * 2.5 + 500 * 10) / 1e6
    assert to_micro_usd(worst_case_cost("openai", "gpt-4o", 1000, 500) or 0) == 7500


def test_worst_case_near_a_threshold_takes_the_higher_tier() -> None:
    # a prompt bound of 250 K may turn out to be 190 K (short tier) or 250 K (long): the long is dearer
    assert worst_case_cost("gemini", "gemini-2.5-pro", 250_000, 10_000) == (250_000 * 2.5 + 10_000 * 15) / 1e6


def test_worst_case_rounds_up() -> None:
    table = PriceTable({"x/m": Price(0.000123, 0.0, 0.0)})
    assert table.worst_case_cost("x", "m", 7, 0) == 1e-08
    assert table.cost("x", "m", Usage(7)) == 0.0


def test_worst_case_refuses_negative_bounds() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        worst_case_cost("openai", "gpt-4o", 10, -5)


@hypothesis.given(
    key=st.sampled_from(sorted(BUILTIN_PRICES)),
    bound=st.integers(0, 2_000_000),
    max_tokens=st.integers(0, 200_000),
    data=st.data(),
)
def test_no_usage_within_the_bounds_costs_more_than_the_worst_case(
    key: str, bound: int, max_tokens: int, data: st.DataObject
) -> None:
    provider, model = key.split("/", 1)
    prompt = data.draw(st.integers(0, bound))
    cached = data.draw(st.integers(0, prompt))
    completion = data.draw(st.integers(0, max_tokens))
    worst = worst_case_cost(provider, model, bound, max_tokens)
    actual = cost(provider, model, Usage(prompt, completion, cached))
    assert worst is not None and actual is not None
    assert actual <= worst
    assert to_micro_usd(actual) <= to_micro_usd(worst)


# ---- micro-dollars ----------------------------------------------------------------------------


def test_to_micro_usd_rounds_up_without_float_noise() -> None:
    assert to_micro_usd(0.000001) == 1  # 0.000001 * 1e6 is 1.0000000000000002 in floats
    assert to_micro_usd(0.0000011) == 2
    assert to_micro_usd(0.00725) == 7250
    assert to_micro_usd(0.0) == 0
    assert to_micro_usd(3) == 3_000_000
    assert to_micro_usd(Decimal("0.0000000001")) == 1
    for bad in (-0.01, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            to_micro_usd(bad)
    with pytest.raises(TypeError):
        to_micro_usd(True)


# ---- overrides ----------------------------------------------------------------------------


def test_programmatic_overrides_replace_and_add() -> None:
    table = BUILTIN_PRICES.with_overrides(
        {
            "openai/gpt-4o": {"input": 2.0, "cached_input": 1.0, "output": 8},
            "ollama/llama3.1": Price(0.0, 0.0, 0.0),
            "openai/my-finetune": {"input": 0.3, "output": 1.2},
        }
    )
    assert table.lookup("openai", "gpt-4o-2024-08-06") == Price(2.0, 1.0, 8.0)
    assert table.lookup("ollama", "llama3.1") == Price(0.0, 0.0, 0.0)
    assert table.lookup("openai", "my-finetune") == Price(0.3, 0.3, 1.2)  # cached defaults to input
    assert cost("openai", "gpt-4o", Usage(1_000_000), table=table) == 2.0
    assert BUILTIN_PRICES.lookup("openai", "gpt-4o") == Price(2.5, 1.25, 10.0)  # unchanged


def test_bad_programmatic_overrides_name_the_entry() -> None:
    with pytest.raises(ValueError, match=r"'openai/gpt-4o': 'output' is missing"):
        BUILTIN_PRICES.with_overrides({"openai/gpt-4o": {"input": 1}})
    with pytest.raises(ValueError, match="provider/model"):
        BUILTIN_PRICES.with_overrides({"gpt-4o": Price(1, 1, 1)})


def test_the_pricing_file_overrides_the_builtin_prices(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = write_json(
        tmp_path / "prices.json",
        {
            "openai/gpt-4o": {"input": 2.0, "cached_input": 1.0, "output": 8.0},
            "openrouter/meta-llama/llama-3.1-70b": {"input": 0.4, "output": 0.4},
            "gemini/gemini-3-pro": {
                "input": 2,
                "output": 12,
                "long_context_above": 200000,
                "long_context": {"input": 4, "output": 18},
            },
        },
    )
    monkeypatch.setenv(ENV_PRICING_FILE, str(path))
    assert cost("openai", "gpt-4o-2024-11-20", Usage(1_000_000, 0, 500_000)) == 1.5
    assert cost("openai", "gpt-4o-mini", Usage(1_000_000)) == 0.15  # the rest stays built in
    assert cost("openrouter", "meta-llama/llama-3.1-70b", Usage(1_000_000, 1_000_000)) == 0.8
    assert worst_case_cost("gemini", "gemini-3-pro", 300_000, 0) == 1.2
    assert pricing.default_table() is pricing.default_table()  # read once while unchanged


def test_an_edited_pricing_file_takes_effect(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write_json(tmp_path / "prices.json", {"openai/gpt-4o": {"input": 2, "output": 8}})
    monkeypatch.setenv(ENV_PRICING_FILE, str(path))
    assert cost("openai", "gpt-4o", Usage(1_000_000)) == 2.0
    write_json(path, {"openai/gpt-4o": {"input": 2.25, "output": 8}})
    assert cost("openai", "gpt-4o", Usage(1_000_000)) == 2.25


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", r"not valid JSON \(.* at line 1, column 2\)"),
        ("[1, 2]", "must be a JSON object"),
        ('{"gpt-4o": {"input": 1, "output": 2}}', r"entry 'gpt-4o': the key must be \"provider/model\""),
        ('{"openai/gpt-4o": {"input": 1}}', r"entry 'openai/gpt-4o': 'output' is missing"),
        ('{"openai/gpt-4o": {"input": 1, "ouput": 2}}', r"entry 'openai/gpt-4o': unknown field 'ouput'"),
        ('{"openai/gpt-4o": {"input": -1, "output": 2}}', r"'input' must be a number >= 0"),
        ('{"openai/gpt-4o": {"input": "2.5", "output": 2}}', r"'input' must be a number >= 0 .*'2.5'"),
        ('{"openai/gpt-4o": {"input": true, "output": 2}}', r"'input' must be a number"),
        ('{"openai/gpt-4o": [2.5, 10]}', r"entry 'openai/gpt-4o': the prices must be an object, got list"),
        ('{"openai/x": {"input": 1, "output": 2, "long_context_above": 10}}', "give both or neither"),
        (
            '{"openai/x": {"input": 1, "output": 2, "long_context_above": 0, "long_context": '
            '{"input": 2, "output": 4}}}',
            "long_context_above must be a number of tokens >= 1",
        ),
        (
            '{"openai/x": {"input": 1, "output": 2, "long_context_above": 5, "long_context": '
            '{"input": 2, "output": 4, "long_context_above": 9}}}',
            r"long_context: unknown field 'long_context_above'",
        ),
        (
            '{"openai/gpt-4o": {"input": 1, "output": 2}, "openai/gpt-4o": {"input": 3, "output": 4}}',
            "entry 'openai/gpt-4o' appears twice",
        ),
    ],
)
def test_a_malformed_pricing_file_says_which_entry_and_what_is_wrong(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "prices.json"
    path.write_text(content)
    monkeypatch.setenv(ENV_PRICING_FILE, str(path))
    with pytest.raises(ConfigurationError, match=message) as caught:
        pricing.default_table()
    assert str(path) in str(caught.value)
    with pytest.raises(ConfigurationError, match=message):
        cost("openai", "gpt-4o", Usage(1))  # never silently priced from the built-in table


def test_a_missing_pricing_file_names_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_PRICING_FILE, str(tmp_path / "absent.json"))
    with pytest.raises(ConfigurationError, match=f"{ENV_PRICING_FILE}=.*absent.json: cannot read it"):
        pricing.default_table()


def test_an_unset_or_empty_variable_means_the_builtin_prices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pricing.default_table() is BUILTIN_PRICES
    monkeypatch.setenv(ENV_PRICING_FILE, " ")
    assert pricing.default_table() is BUILTIN_PRICES


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input": -1.0, "cached_input": 0.0, "output": 0.0}, "input must be >= 0"),
        ({"input": 1.0, "cached_input": float("nan"), "output": 0.0}, "cached_input must be a number"),
        ({"input": 1.0, "cached_input": 1.0, "output": 1.0, "long_context_above": 5}, "both or neither"),
    ],
)
def test_price_checks_its_numbers(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Price(**kwargs)  # type: ignore[arg-type]


def test_anthropic_cache_writes_are_billed_at_a_quarter_above_the_input_price() -> None:
    from sluice.llm.anthropic import anthropic_usage

    usage = anthropic_usage(
        {"usage": {"input_tokens": 100, "cache_creation_input_tokens": 800, "cache_read_input_tokens": 100}}
    )
    assert (usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens) == (1000, 100, 800)
    price = price_for("anthropic", "claude-3-5-haiku")
    assert price is not None and price.cache_write == pytest.approx(price.input * 1.25)
    expected = (100 * price.input + 100 * price.cached_input + 800 * price.input * 1.25) / 1e6
    assert cost("anthropic", "claude-3-5-haiku", usage) == pytest.approx(expected, abs=1e-8)
    # and the worst case a money budget reserves covers a prompt written to the cache in full
    worst = worst_case_cost("anthropic", "claude-3-5-haiku", 1000, 0)
    written = cost("anthropic", "claude-3-5-haiku", Usage(1000, 0, 0, cache_write_tokens=1000))
    assert worst is not None and written is not None and worst >= written


def test_an_override_may_price_cache_writes(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text('{"anthropic/claude-x": {"input": 3, "output": 15, "cache_write": 6}}')
    table = BUILTIN_PRICES.with_overrides_from_file(path)
    assert table.cost("anthropic", "claude-x", Usage(10, 0, 0, cache_write_tokens=10)) == pytest.approx(6e-5)
    path.write_text('{"anthropic/claude-x": {"input": 3, "output": 15, "cache_write": -1}}')
    with pytest.raises(ConfigurationError, match="cache_write"):
        BUILTIN_PRICES.with_overrides_from_file(path)
