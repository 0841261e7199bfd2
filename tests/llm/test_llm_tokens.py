"""Token counts for reservations: exact for OpenAI, an upper bound for everyone else.

The reference every exact count is checked against is a tiktoken ``Encoding`` built by tiktoken's
*own* constructor for the encoding (``tiktoken_ext.openai_public``), fed the vendored ranks instead
of its download: so the regex and special tokens Sluice carries are checked against tiktoken's,
and the ranks against the hash tiktoken expects for OpenAI's published files.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib
import json
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import tiktoken
import tiktoken.load
from hypothesis import strategies as st

from sluice.errors import ConfigurationError
from sluice.llm import tokens
from sluice.llm.provider import Message

NAMES = ("cl100k_base", "o200k_base")

#: Prefixes of the hashes the research report gives for OpenAI's published files.
REPORTED_PREFIXES = {"cl100k_base": "223921b7", "o200k_base": "446a9538"}

#: Token counts of fixed strings, computed independently with puretiktoken 0.2.1 (a pure-Python
#: reimplementation, run outside this venv): (text, cl100k_base, o200k_base).
KNOWN_COUNTS = [
    ("hello world", 2, 2),
    ("Hello, world! How are you today?", 9, 9),
    ("日本語のテキストを数える。", 13, 10),
    ("def f(x):\n    return x ** 2\n", 11, 11),
    ('{"id": 12345, "tags": ["a", "b"]}', 16, 17),
    ("\U0001f389\U0001f680 emoji test \U0001f469\u200d\U0001f469\u200d\U0001f467", 20, 14),
    ("3.14159265358979 2718281828", 12, 12),
    ("<|endoftext|>", 7, 7),
    ("Привет, мир!", 7, 5),
    ("", 0, 0),
    ("user", 1, 1),
    ("system", 1, 1),
    ("assistant", 1, 1),
]

_PROSE = (
    "The committee met on Tuesday to review the quarterly figures. Revenue rose by four percent, "
    "while costs held steady; the chair asked for a breakdown by region before the next meeting, "
    "and noted that the new warehouse in Leeds had opened two weeks ahead of schedule.\n\n"
)
_CODE = '''def retry(fn, attempts=3, backoff=0.5):
    """Call fn until it succeeds or attempts run out."""
    for i in range(attempts):
        try:
            return fn()
        except (TimeoutError, ConnectionError) as exc:  # transient
            time.sleep(backoff * 2 ** i)
    raise RuntimeError(f"gave up after {attempts} attempts")
'''
_RECORD = {"id": "job-00421", "tags": ["llm", "batch"], "score": 0.9172, "nested": {"ok": True, "n": None}}

#: A small multilingual corpus, written for this test: what the byte estimate must bound.
CORPUS = {
    "english prose": _PROSE * 4,
    "markdown": "# Release notes\n\n- **Fixed**: retries no longer double-count.\n- *Added*: `--dry-run`.\n"
    "\n| col | value |\n|---|---|\n| a | 1 |\n| b | 2 |\n\n> Quote with a [link](https://example.com).\n" * 3,
    "python": _CODE * 3,
    "json compact": json.dumps([_RECORD] * 8, separators=(",", ":")),
    "json pretty": json.dumps([_RECORD] * 4, indent=2),
    "numbers": " ".join(str(n * 7919 % 100_003) for n in range(300)),
    "floats csv": "\n".join(f"{i},{i * 0.3141592:.6f},{-i * 2.718:.3e}" for i in range(80)),
    "chinese": "队列在分派任务之前为每个任务预留令牌，调用结束后再按实际用量结算。预算可以用金额表示。" * 6,  # noqa: RUF001
    "japanese": "ジョブは送信前にトークンを予約し、呼び出しの後で実際の使用量に合わせて精算されます。" * 6,
    "korean": "작업은 호출 전에 토큰을 예약하고 호출 후 실제 사용량으로 정산됩니다. " * 8,
    "russian": "Задание резервирует токены до вызова и уточняет расход после ответа провайдера. " * 8,
    "arabic": "تحجز المهمة الرموز قبل الاستدعاء ثم تسوي الحساب وفق الاستخدام الفعلي بعد الرد. " * 8,
    "hindi": "कार्य कॉल से पहले टोकन आरक्षित करता है और उत्तर के बाद वास्तविक उपयोग के अनुसार हिसाब करता है। " * 6,
    "thai": "งานจะจองโทเค็นก่อนเรียกใช้และปรับยอดตามการใช้งานจริงหลังจากได้รับคำตอบ " * 8,
    "emoji": "🎉🚀👩‍👩‍👧🇯🇵🇫🇷👍🏽✨🔥💯🧪 launch day! " * 12,
    "hex": "".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(20)),
    "base64": base64.b64encode(hashlib.sha512(b"sluice").digest() * 12).decode(),
    "uuids": "\n".join(f"{i:08x}-4e3b-4c1d-9a2f-{i * 7919:012x}" for i in range(40)),
    "whitespace": "col1\t\tcol2\n    indented\n\n\n        deeper   trailing   \n" * 10,
    "special tokens": "<|endoftext|><|im_start|>system<|im_end|><|endofprompt|>" * 5,
}


@functools.cache
def vendored_content(name: str) -> bytes:
    return gzip.decompress(tokens.rank_file(name).read_bytes())


@functools.cache
def vendored_ranks(name: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in vendored_content(name).splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tiktoken_definition(name: str) -> dict[str, Any]:
    """What tiktoken's own constructor for ``name`` builds, with its download replaced by the
    vendored ranks (the replacement checks that tiktoken asks for the hash Sluice checks)."""
    openai_public = importlib.import_module("tiktoken_ext.openai_public")
    asked: list[str] = []

    def load(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        assert url.endswith(f"/{name}.tiktoken")
        asked.append(expected_hash or "")
        return vendored_ranks(name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(openai_public, "load_tiktoken_bpe", load)
        definition: dict[str, Any] = getattr(openai_public, name)()
    assert asked == [tokens.RANK_FILE_SHA256[name]]
    return definition


@functools.cache
def reference(name: str) -> tiktoken.Encoding:
    return tiktoken.Encoding(**tiktoken_definition(name))


def exact(name: str, text: str) -> int:
    return len(reference(name).encode_ordinary(text))


def chat_bound(name: str, messages: list[Message]) -> int:
    """The documented OpenAI formula, from the reference encoding."""
    per_message = (
        tokens.OPENAI_TOKENS_PER_MESSAGE + exact(name, m["role"]) + exact(name, m["content"])
        for m in messages
    )
    return tokens.OPENAI_TOKENS_PER_REPLY + sum(per_message)


# ---- the vendored files --------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_vendored_rank_files_are_the_published_ones(name: str) -> None:
    digest = hashlib.sha256(vendored_content(name)).hexdigest()
    assert digest == tokens.RANK_FILE_SHA256[name]
    assert digest.startswith(REPORTED_PREFIXES[name])
    # tiktoken's source names the same hash for the file it would download
    assert digest in Path(importlib.import_module("tiktoken_ext.openai_public").__file__ or "").read_text()


@pytest.mark.parametrize("name", NAMES)
def test_encoding_definition_equals_tiktokens(name: str) -> None:
    definition = tiktoken_definition(name)
    ours = tokens.load_encoding(name)
    assert definition["pat_str"] == tokens._DEFINITIONS[name].pattern
    assert definition["special_tokens"] == dict(tokens._DEFINITIONS[name].special_tokens)
    assert ours.n_vocab == reference(name).n_vocab
    assert ours.name == name


def test_the_licence_and_origin_ship_with_the_files() -> None:
    notice = resources.files("sluice.llm").joinpath("data", "tiktoken-LICENSE.txt").read_text()
    assert "MIT License" in notice and "OpenAI" in notice
    for name in NAMES:
        assert tokens.RANK_FILE_SHA256[name] in notice


def test_loading_uses_neither_download_nor_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("tiktoken's loaders download and write cache files")

    monkeypatch.setattr(tiktoken, "get_encoding", forbidden)
    monkeypatch.setattr(tiktoken.load, "load_tiktoken_bpe", forbidden)
    monkeypatch.setattr(tiktoken.load, "read_file_cached", forbidden)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    copy = tmp_path_factory.mktemp("ranks") / "o200k_base.tiktoken.gz"
    copy.write_bytes(tokens.rank_file("o200k_base").read_bytes())
    assert len(tokens.load_encoding("o200k_base", path=copy).encode_ordinary("hello world")) == 2
    assert list(tmp_path.iterdir()) == []


# ---- exact counts ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "cl100k", "o200k"), KNOWN_COUNTS)
def test_known_token_counts(text: str, cl100k: int, o200k: int) -> None:
    assert len(tokens.load_encoding("cl100k_base").encode_ordinary(text)) == cl100k
    assert len(tokens.load_encoding("o200k_base").encode_ordinary(text)) == o200k


@pytest.mark.parametrize("name", NAMES)
def test_counts_equal_the_reference_encoding(name: str) -> None:
    ours = tokens.load_encoding(name)
    for text in [*CORPUS.values(), *(text for text, _, _ in KNOWN_COUNTS)]:
        assert ours.encode_ordinary(text) == reference(name).encode_ordinary(text)


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("gpt-4o", "o200k_base"),
        ("gpt-4o-2024-08-06", "o200k_base"),
        ("gpt-4.1-mini", "o200k_base"),
        ("o3-mini", "o200k_base"),
        ("o1", "o200k_base"),
        ("gpt-5", "o200k_base"),
        ("gpt-7-turbo", "o200k_base"),  # unknown to tiktoken: the newest encoding
        ("chatgpt-4o-latest", "o200k_base"),
        ("ft:gpt-4o-mini:acme::x1", "o200k_base"),
        ("openai/gpt-4o-mini", "o200k_base"),
        ("GPT-4O", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-3.5-turbo-0125", "cl100k_base"),
        ("gpt-35-turbo", "cl100k_base"),
        ("text-embedding-3-small", "cl100k_base"),
        ("llama3.1:8b", None),
        ("gpt-oss:20b", None),
        ("gpt-j-6b", None),
        ("gpt2", None),
        ("ollama-o1", None),
        ("mistral-large", None),
    ],
)
def test_the_model_name_chooses_the_encoding(model: str, name: str | None) -> None:
    assert tokens.encoding_name("openai", model) == name


def test_anthropic_and_gemini_are_never_counted_with_tiktoken() -> None:
    assert tokens.encoding_name("anthropic", "claude-sonnet-4-5") is None
    assert tokens.encoding_name("gemini", "gemini-2.5-flash") is None
    assert tokens.encoding_name("gemini", "gpt-4o") is None


@pytest.mark.parametrize(("model", "name"), [("gpt-4o-mini", "o200k_base"), ("gpt-4-turbo", "cl100k_base")])
def test_chat_count_is_exact_plus_the_documented_framing(model: str, name: str) -> None:
    chat: list[Message] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": CORPUS["japanese"]},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": CORPUS["python"]},
    ]
    counted = tokens.count_prompt_tokens(chat, provider="openai", model=model)
    assert counted == chat_bound(name, chat)
    content_only = sum(exact(name, m["content"]) for m in chat)
    # three framing tokens a message are OpenAI's own figure, plus the role; ours adds one more
    assert counted == content_only + 3 + len(chat) * (3 + 1 + 1)
    assert tokens.count_prompt_tokens([], provider="openai", model=model) == tokens.OPENAI_TOKENS_PER_REPLY


def test_a_string_counts_as_one_user_message() -> None:
    text = "hello world"
    counted = tokens.count_prompt_tokens(text, provider="openai", model="gpt-4o")
    assert counted == tokens.count_prompt_tokens(
        [{"role": "user", "content": text}], provider="openai", model="gpt-4o"
    )
    assert counted == 2 + 1 + tokens.OPENAI_TOKENS_PER_MESSAGE + tokens.OPENAI_TOKENS_PER_REPLY
    # an embeddings call on the same text counts only the 2 tokens: still bounded
    assert counted >= len(tokens.load_encoding("o200k_base").encode_ordinary(text))


def test_reservation_adds_max_tokens() -> None:
    chat: list[Message] = [{"role": "user", "content": "hello world"}]
    for provider, model in (("openai", "gpt-4o"), ("anthropic", "claude-3-5-haiku-20241022")):
        prompt = tokens.count_prompt_tokens(chat, provider=provider, model=model)
        assert tokens.reservation(chat, provider=provider, model=model, max_tokens=256) == prompt + 256
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_tokens"):
            tokens.reservation(chat, provider="openai", model="gpt-4o", max_tokens=bad)  # type: ignore[arg-type]


def test_a_reservation_covers_the_providers_limiter_estimate_too() -> None:
    """English prose tokenizes below characters / 4, which OpenAI's limiter (and the simulated
    provider) count on arrival: the reservation takes the larger, so the queue's token window
    never admits what the provider's refuses."""
    from sluice.testing.simulated_model import count_prompt_tokens as provider_counts

    prose = "The export to CSV stops after the first page of results, every time. " * 20
    chat: list[Message] = [{"role": "user", "content": prose}]
    exact = tokens.count_prompt_tokens(chat, provider="openai", model="gpt-4o")
    counted_by_limiter = provider_counts(chat)
    assert exact < counted_by_limiter == tokens.limiter_estimate(chat)
    assert (
        tokens.reservation(chat, provider="openai", model="gpt-4o", max_tokens=100)
        == counted_by_limiter + 100
    )


def test_malformed_messages_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="message 1"):
        tokens.count_prompt_tokens(
            [{"role": "user", "content": "a"}, {"role": "user", "content": None}],  # type: ignore[typeddict-item]
            provider="openai",
            model="gpt-4o",
        )


# ---- the estimate ----------------------------------------------------------------------------


def test_estimate_is_bytes_plus_sixteen_a_message() -> None:
    chat: list[Message] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本"}]
    expected = len(b"Be brief.") + 16 + len("日本".encode()) + 16
    assert tokens.estimate_prompt_tokens(chat) == expected
    for provider, model in (
        ("anthropic", "claude-sonnet-4-5-20250929"),
        ("gemini", "gemini-2.5-pro"),
        ("openai", "llama3.1:70b"),
        ("ollama", "qwen2.5"),
        ("simulated", "sim"),
    ):
        assert tokens.count_prompt_tokens(chat, provider=provider, model=model) == expected
    assert tokens.estimate_prompt_tokens("") == 16


@pytest.mark.parametrize("kind", sorted(CORPUS))
def test_estimate_bounds_openais_counts_on_the_corpus(kind: str) -> None:
    """A sanity check of the report's measurement: the estimate never falls below what cl100k or
    o200k count, framing included, on any kind of text (CJK and emoji are the tight ones)."""
    text = CORPUS[kind]
    chat: list[Message] = [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": text},
    ]
    estimate = tokens.estimate_prompt_tokens(chat)
    for name in NAMES:
        assert exact(name, text) <= len(text.encode())
        assert chat_bound(name, chat) <= estimate, (name, kind)


# ---- loading: once, from any thread; a damaged file is refused ------------------------------


def test_lazy_load_happens_once_for_many_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "_cache", {})
    real_build = tokens._build
    builds: list[str] = []

    def counting_build(name: str, where: str, compressed: bytes) -> tiktoken.Encoding:
        builds.append(name)
        return real_build(name, where, compressed)

    monkeypatch.setattr(tokens, "_build", counting_build)
    start = threading.Barrier(8)
    results: list[tuple[str, tiktoken.Encoding, int]] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        name = NAMES[i % 2]
        try:
            start.wait()
            counted = tokens.count_prompt_tokens("hello world", provider="openai", model="gpt-4o")
            results.append((name, tokens.load_encoding(name), counted))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sorted(builds) == sorted(NAMES)
    for name in NAMES:
        assert len({id(encoding) for n, encoding, _ in results if n == name}) == 1
    assert {counted for _, _, counted in results} == {2 + 1 + 4 + 3}


@pytest.fixture
def vendored_copy(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "cl100k_base.tiktoken.gz"
    path.write_bytes(tokens.rank_file("cl100k_base").read_bytes())
    yield path


def test_a_copy_of_the_vendored_file_loads(vendored_copy: Path) -> None:
    assert len(tokens.load_encoding("cl100k_base", path=vendored_copy).encode_ordinary("hello world")) == 2


def test_a_flipped_byte_is_refused_with_a_clear_error(vendored_copy: Path) -> None:
    data = bytearray(vendored_copy.read_bytes())
    data[len(data) // 2] ^= 0x01
    vendored_copy.write_bytes(bytes(data))
    with pytest.raises(ConfigurationError) as caught:
        tokens.load_encoding("cl100k_base", path=vendored_copy)
    message = str(caught.value)
    assert str(vendored_copy) in message
    assert "damaged" in message and "reinstall" in message


def test_changed_ranks_are_refused_by_their_hash(vendored_copy: Path) -> None:
    content = gzip.decompress(vendored_copy.read_bytes())
    first, rest = content.split(b"\n", 1)
    token, _ = first.split()
    vendored_copy.write_bytes(gzip.compress(token + b" 100300\n" + rest))  # a valid gzip, other ranks
    with pytest.raises(ConfigurationError, match=r"sha256 [0-9a-f]{64}, but OpenAI's cl100k_base has 2239"):
        tokens.load_encoding("cl100k_base", path=vendored_copy)


def test_a_missing_file_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read the token rank file"):
        tokens.load_encoding("o200k_base", path=tmp_path / "absent.tiktoken.gz")


def test_unknown_encoding_names_are_refused() -> None:
    with pytest.raises(ValueError, match="p50k_base"):
        tokens.load_encoding("p50k_base")


# ---- long texts: counted in pieces, never below the count -----------------------------------


def test_long_prose_is_counted_exactly_in_pieces() -> None:
    text = (_PROSE + CORPUS["russian"] + "\n" + _CODE) * 400  # ~430 000 characters
    for name in NAMES:
        counted, was_exact = tokens._count_text(tokens.load_encoding(name), text)
        assert was_exact
        assert counted == exact(name, text)


def test_a_huge_whitespace_run_does_not_crash_tiktoken() -> None:
    """o200k's regex panics on a run of about a million spaces; the run is bounded by its bytes."""
    text = "begin" + " " * 1_200_000 + "end"
    counted = tokens.count_prompt_tokens(text, provider="openai", model="gpt-4o")
    assert counted >= len(text.encode()) - 8  # bounded, not counted: at least the bytes
    chunked, was_exact = tokens._count_text(tokens.load_encoding("o200k_base"), " " * 150_000 + "x")
    assert not was_exact and chunked == 150_001


_ATOMS = [
    "a", "Z", "é", "ß", "ǅ", "ʰ", "日本", "한", "я", " ", "  ", "\n", "\r\n", "\n\n", "\t", ".", "/",
    "'s", "'LL", "1", "234", "½", "\u0301", "\u0903", "\u00a0", "\x1c", "😀", "👩‍👩‍👧", "{", '"', "_",
    " word", "Word", " WORD", "\n  x", "x\n/",
]  # fmt: skip


@hypothesis.settings(max_examples=300)
@hypothesis.given(
    atoms=st.lists(st.sampled_from(_ATOMS), max_size=40),
    name=st.sampled_from(NAMES),
    segment=st.integers(1, 40),
)
def test_cutting_at_boundaries_never_changes_the_count(atoms: list[str], name: str, segment: int) -> None:
    text = "".join(atoms)
    encoding = tokens.load_encoding(name)
    whole = len(encoding.encode_ordinary(text))
    for match in tokens._BOUNDARY.finditer(text, 1):
        at = match.start()
        if tokens._is_boundary(text, at):
            assert exact(name, text[:at]) + exact(name, text[at:]) == whole, (text, at)
    counted, was_exact = tokens._count_text(encoding, text, segment)
    assert counted == whole if was_exact else counted >= whole
