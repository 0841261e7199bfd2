"""How many input tokens a prompt may cost, counted before the call, for reservations.

A job that calls an LLM reserves ``prompt tokens + max_tokens`` against its
budget before it is dispatched, and the reservation is corrected to the
usage the provider reports once the call is over. The invariant that makes
budgets safe is that **the reservation is never below the real usage**, so
everything here is an *upper bound* of what the provider will count, never a
best guess that could fall short:

* OpenAI's models (and OpenAI-compatible servers serving models named like
  OpenAI's: ``gpt-<digit>…``, ``o1``/``o3``/``o4…``, ``chatgpt-…``,
  ``text-embedding-…``, with an optional ``openai/`` or ``ft:`` prefix): counted
  exactly with ``tiktoken``, plus the chat framing (see
  :data:`OPENAI_TOKENS_PER_MESSAGE`). The BPE rank files of cl100k_base and
  o200k_base ship inside Sluice (``sluice/llm/data``, gzipped, sha256-checked on
  every load) and the ``tiktoken.Encoding`` is built from them here: tiktoken's
  own ``get_encoding`` downloads the files and ``load_tiktoken_bpe`` writes
  cache copies, and a worker must neither reach the network nor write files
  to count tokens.
* Everything else (Anthropic, Gemini, Ollama and other local models, unknown
  names): :func:`estimate_prompt_tokens`, the UTF-8 byte count of the content
  plus :data:`ESTIMATE_TOKENS_PER_MESSAGE` per message. There is no offline
  tokenizer for Claude 3+ or Gemini, and the byte count is the only simple
  estimate that was never exceeded on a 168-chunk multilingual corpus by any
  tokenizer measured (cl100k, o200k, two Claude reconstructions, a
  Gemma-256k proxy; the worst ratio of tokens to bytes was 1.00, on digits).
  It over-reserves English about 3-5 times; the excess costs admission
  headroom only, because settlement refunds the reservation down to the
  usage reported.

Loading an encoding takes a noticeable fraction of a second, so it happens
lazily, once per process, under a lock (:func:`preload` does it ahead of time,
e.g. at worker start, off the event loop); counting after that is cheap, and
grows with the text. Texts over 100 000 characters are counted in pieces cut
where the count cannot change (tiktoken's regex panics on a whitespace run of
about a million characters); a stretch that long with no such cut is bounded
by its UTF-8 bytes instead of counted.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import os
import re
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING

from sluice.errors import ConfigurationError
from sluice.extras import require
from sluice.llm.provider import Message

if TYPE_CHECKING:
    import tiktoken

__all__ = [
    "ESTIMATE_TOKENS_PER_MESSAGE",
    "OPENAI_TOKENS_PER_MESSAGE",
    "OPENAI_TOKENS_PER_REPLY",
    "RANK_FILE_SHA256",
    "count_prompt_tokens",
    "encoding_name",
    "estimate_prompt_tokens",
    "load_encoding",
    "preload",
    "rank_file",
    "reservation",
]

#: Framing added per message by the byte estimate. Claude's per-message frame is 6-11 tokens
#: (measured on offline reconstructions of its counter), so 16 leaves room for roles and for
#: framing nobody could measure offline (Gemini's).
ESTIMATE_TOKENS_PER_MESSAGE = 16

#: Framing OpenAI counts per chat message, on top of the tokens of its role and content. OpenAI's
#: cookbook ("How to count tokens with tiktoken") uses 3, for ``<|start|>{role}<|message|>`` and
#: ``<|end|>``, and its published runs matched the API's ``prompt_tokens`` from gpt-3.5-turbo-0613
#: to gpt-4o-mini; a third-party run on gpt-5 found the API counting one token *fewer* than that
#: formula (pydantic/pydantic-ai#3447). 4 is one more: the cookbook's figure for the retired
#: gpt-3.5-turbo-0301, and a margin for the one-token changes OpenAI has made to its counting
#: before (openai/tiktoken#71), so the sum stays an upper bound if that happens again.
OPENAI_TOKENS_PER_MESSAGE = 4

#: Tokens OpenAI counts once per request for the reply's primer ``<|start|>assistant<|message|>``
#: (the cookbook's figure, matched by the API as above).
OPENAI_TOKENS_PER_REPLY = 3

#: sha256 of the *uncompressed* rank files: the hashes tiktoken itself expects for the files OpenAI
#: publishes (tiktoken_ext/openai_public.py), so a match means these are OpenAI's files, unaltered.
RANK_FILE_SHA256: Mapping[str, str] = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}

# The rest of each encoding's definition: the pre-tokenizing regex and the special tokens, as
# OpenAI defines them in tiktoken_ext/openai_public.py (tests/llm/test_llm_tokens.py checks that they
# still equal what the installed tiktoken builds).
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PATTERN = "|".join(
    (
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    )
)


@dataclass(frozen=True, slots=True)
class _Definition:
    pattern: str
    special_tokens: Mapping[str, int]


_DEFINITIONS: Mapping[str, _Definition] = {
    "cl100k_base": _Definition(
        _CL100K_PATTERN,
        {
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
    "o200k_base": _Definition(_O200K_PATTERN, {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}),
}

#: Providers whose models are never counted with tiktoken, whatever their names.
_ESTIMATED_PROVIDERS = frozenset({"anthropic", "gemini", "google", "vertex", "vertexai"})

# Names of OpenAI's models (after an optional "openai/" prefix): gpt-<digit> (gpt-3.5, gpt-35 on
# Azure, gpt-4*, gpt-5*), o1/o3/o4..., chatgpt-..., text-embedding-..., and fine-tunes of them.
# gpt-j, gpt-neox and gpt-oss are left out on purpose: other tokenizers, or (gpt-oss) a chat
# template that adds a hidden system message this module cannot see.
_OPENAI_NAME = re.compile(r"(?:ft:)?(?:gpt-\d|chatgpt-|o\d+(?:-|$)|text-embedding-)")

# Where a long text may be cut for counting without changing its count (see _count_text): before
# a letter that follows a newline, or at a space between two letters. These are candidates:
# _is_boundary checks the letters with str.isalpha, since [^\W\d_] also admits numerals like "½".
_BOUNDARY = re.compile(r"(?<=\n)(?=[^\W\d_])|(?<=[^\W\d_]) (?=[^\W\d_])")
_SEGMENT_CHARS = 100_000

_cache: dict[str, tiktoken.Encoding] = {}
_locks: Mapping[str, threading.Lock] = {name: threading.Lock() for name in _DEFINITIONS}


def rank_file(name: str) -> Traversable:
    """The gzipped rank file of encoding ``name`` shipped inside Sluice (``sluice/llm/data``)."""
    if name not in _DEFINITIONS:
        raise ValueError(f"no rank file for encoding {name!r}; Sluice ships {sorted(_DEFINITIONS)}")
    return resources.files("sluice.llm").joinpath("data", f"{name}.tiktoken.gz")


def load_encoding(name: str, *, path: str | os.PathLike[str] | None = None) -> tiktoken.Encoding:
    """The tiktoken ``Encoding`` ``name`` ("cl100k_base" or "o200k_base"), built from a rank file.

    Without ``path`` the file shipped in Sluice is used, and the encoding is built once per
    process and shared (concurrent first calls wait for one build, since it is slow).
    With ``path`` (a gzipped ``.tiktoken`` file) a new encoding is built each call and nothing is
    cached: that is for checking another copy of the file.

    Raises ConfigurationError if the file cannot be read, is not gzip, or its content's sha256 is
    not the published one (a damaged installation: counts from such a file could be too low);
    MissingExtra if tiktoken is not installed.
    """
    if name not in _DEFINITIONS:
        raise ValueError(f"unknown encoding {name!r}; Sluice ships {sorted(_DEFINITIONS)}")
    if path is not None:
        where = os.fspath(path)
        return _build(name, where, _read(where, Path(where).read_bytes))
    encoding = _cache.get(name)
    if encoding is not None:
        return encoding
    with _locks[name]:
        encoding = _cache.get(name)
        if encoding is None:
            source = rank_file(name)
            encoding = _build(name, str(source), _read(str(source), source.read_bytes))
            _cache[name] = encoding
        return encoding


def preload(*names: str) -> None:
    """Load encodings now (default: both) rather than on the first count, e.g. when a worker
    starts; it blocks for a fraction of a second each, so call it from a thread when a loop
    is running."""
    for name in names or tuple(_DEFINITIONS):
        load_encoding(name)


def encoding_name(provider: str, model: str) -> str | None:
    """The encoding that counts ``model``'s tokens exactly, or None when only the estimate applies.

    The model's name decides (an OpenAI-compatible server may be a proxy in front of OpenAI),
    except that Anthropic's and Gemini's models are always estimated. The encoding is the one
    ``tiktoken.model.encoding_name_for_model`` names, else o200k_base (that of every OpenAI
    model since gpt-4o). A name tiktoken maps to an encoding Sluice does not ship is estimated.
    """
    if provider.strip().lower() in _ESTIMATED_PROVIDERS:
        return None
    name = model.strip().lower()
    name = name.removeprefix("openai/")
    if not _OPENAI_NAME.match(name):
        return None
    require("llm", "exact token counts for OpenAI models", "tiktoken")
    import tiktoken.model

    try:
        known = tiktoken.model.encoding_name_for_model(name)
    except KeyError:
        return "o200k_base"
    return known if known in _DEFINITIONS else None


def count_prompt_tokens(messages: Sequence[Message] | str, *, provider: str, model: str) -> int:
    """An upper bound of the input tokens ``provider`` will report for ``messages`` to ``model``.

    ``messages`` is a chat (a sequence of ``{"role", "content"}``) or a bare string, which counts
    as one user message: that bounds both a one-message chat and the same text sent to an
    embeddings or completions endpoint, which count no framing.

    For OpenAI's models (:func:`encoding_name` names an encoding) the count is tiktoken's, exact,
    plus :data:`OPENAI_TOKENS_PER_MESSAGE` and the role's tokens per message and
    :data:`OPENAI_TOKENS_PER_REPLY` once. Special-token text such as ``<|endoftext|>`` in a
    message counts as ordinary text, as the API treats it. For every other model it is
    :func:`estimate_prompt_tokens` (see the module's docstring for why that bound holds).
    """
    chat = _as_chat(messages)
    name = encoding_name(provider, model)
    if name is None:
        return _estimate(chat)
    encoding = load_encoding(name)
    total = OPENAI_TOKENS_PER_REPLY
    for role, content in chat:
        role_tokens, _ = _count_text(encoding, role)
        content_tokens, _ = _count_text(encoding, content)
        total += OPENAI_TOKENS_PER_MESSAGE + role_tokens + content_tokens
    return total


def estimate_prompt_tokens(messages: Sequence[Message] | str) -> int:
    """The tokenizer-free upper bound: UTF-8 bytes of every content plus
    :data:`ESTIMATE_TOKENS_PER_MESSAGE` per message (a bare string is one message).

    Byte-level BPE (OpenAI, Claude, Llama 3) never makes more tokens than bytes, and SentencePiece
    with byte fallback (Gemma, Gemini) makes at most one per byte; measured maxima of tokens per
    byte were 0.73 (cl100k), 0.69 (o200k), 0.87 and 0.96 (Claude 3 and 4.7 reconstructions) and
    1.00 (Gemma, digits). A chat template that inserts a hidden system prompt of its own (some
    local models do when the chat has none) is not seen here.
    """
    return _estimate(_as_chat(messages))


#: Characters per token in the estimate a provider's rate limiter makes before it tokenizes
#: (OpenAI's documented rule of thumb, which its limiter uses; the simulated provider too).
LIMITER_CHARS_PER_TOKEN = 4


def limiter_estimate(messages: Sequence[Message] | str) -> int:
    """The prompt tokens a provider's rate limiter counts on arrival, from characters alone:
    the characters of every content / 4, rounded up."""
    chars = sum(len(content) for _, content in _as_chat(messages))
    return -(-chars // LIMITER_CHARS_PER_TOKEN)


def reservation(messages: Sequence[Message] | str, *, provider: str, model: str, max_tokens: int) -> int:
    """Tokens to reserve before calling ``model``: the prompt's upper bound plus ``max_tokens``
    (the most the reply may use; reasoning tokens are part of it).

    The prompt's part is also at least what the provider's rate limiter counts
    (:func:`limiter_estimate`): the same estimate fills the queue's token-rate window, which
    must never admit a call the provider's window refuses. For OpenAI's models the exact
    count is 9-17 % below it on English prose; the budget is corrected to the usage reported
    afterwards, so the excess costs nothing.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    prompt = count_prompt_tokens(messages, provider=provider, model=model)
    return max(prompt, limiter_estimate(messages)) + max_tokens


def _count_text(encoding: tiktoken.Encoding, text: str, segment: int = _SEGMENT_CHARS) -> tuple[int, bool]:
    """Tokens of ``text``, and whether that is exact (False: a stretch was bounded by its bytes).

    Long texts are encoded in pieces of at most ``segment`` characters, cut only at
    :data:`_BOUNDARY` positions, where the encoding's pre-tokenizer always starts a new piece
    whatever comes before or after: a letter that follows a newline, or a space between two
    letters (neither pattern lets a piece run across them, and neither looks behind). So the sum
    of the pieces' counts equals the count of the whole. This keeps every call into tiktoken
    short: its regex engine gives up with a panic on a whitespace run of ~1 M characters, and
    a single unbroken run is slow to encode, more so the longer it is. A stretch longer than
    ``segment`` with no such position is counted as its UTF-8 bytes, which no byte-level BPE
    exceeds.
    """
    if len(text) <= segment:
        return len(encoding.encode_ordinary(text)), True
    total, exact, start, end = 0, True, 0, len(text)
    while end - start > segment:
        cut = _last_boundary(text, start + 1, start + segment)
        if cut is not None:
            total += len(encoding.encode_ordinary(text[start:cut]))
        else:
            following = (m.start() for m in _BOUNDARY.finditer(text, start + segment))
            cut = next((at for at in following if _is_boundary(text, at)), end)
            total += len(text[start:cut].encode("utf-8"))
            exact = False
        start = cut
    return total + len(encoding.encode_ordinary(text[start:])), exact


def _last_boundary(text: str, lo: int, hi: int) -> int | None:
    """The last cut position in ``[lo, hi]``, looking at the end first (prose has one every few
    characters, so scanning the whole window would cost more than the encoding)."""
    span = 256
    while True:
        first = max(lo, hi - span)
        cut = None
        for match in _BOUNDARY.finditer(text, first, hi + 1):
            if _is_boundary(text, match.start()):
                cut = match.start()
        if cut is not None or first == lo:
            return cut
        span *= 16


def _is_boundary(text: str, at: int) -> bool:
    # str.isalpha() is exactly Unicode's \p{L} (Lu, Ll, Lt, Lm, Lo), the class the patterns use.
    if text[at] == " ":
        return at + 1 < len(text) and text[at - 1].isalpha() and text[at + 1].isalpha()
    return text[at - 1] == "\n" and text[at].isalpha()


def _estimate(chat: Sequence[tuple[str, str]]) -> int:
    return sum(len(content.encode("utf-8")) + ESTIMATE_TOKENS_PER_MESSAGE for _, content in chat)


def _as_chat(messages: Sequence[Message] | str) -> list[tuple[str, str]]:
    if isinstance(messages, str):
        return [("user", messages)]
    chat: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        item: object = message
        role = item.get("role") if isinstance(item, Mapping) else None
        content = item.get("content") if isinstance(item, Mapping) else None
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(
                f"message {index} must be a mapping with string 'role' and 'content', got {message!r:.200}"
            )
        chat.append((role, content))
    return chat


def _read(where: str, read: Callable[[], bytes]) -> bytes:
    try:
        return read()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the token rank file {where}: {exc}; reinstall Sluice "
            "(pip install --force-reinstall 'sluice-queue[llm]')"
        ) from exc


def _build(name: str, where: str, compressed: bytes) -> tiktoken.Encoding:
    require("llm", "exact token counts for OpenAI models", "tiktoken")
    import tiktoken

    expected = RANK_FILE_SHA256[name]
    try:
        content = gzip.decompress(compressed)
    except (OSError, EOFError, zlib.error) as exc:
        raise _corrupt(name, where, f"it is not a valid gzip file ({exc})") from exc
    actual = hashlib.sha256(content).hexdigest()
    if actual != expected:
        raise _corrupt(name, where, f"its content has sha256 {actual}, but OpenAI's {name} has {expected}")
    ranks: dict[bytes, int] = {}
    try:
        for line in content.splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except ValueError as exc:  # binascii.Error included; unreachable once the hash matched
        raise _corrupt(name, where, f"a line does not parse ({exc})") from exc
    definition = _DEFINITIONS[name]
    return tiktoken.Encoding(
        name=name,
        pat_str=definition.pattern,
        mergeable_ranks=ranks,
        special_tokens=dict(definition.special_tokens),
    )


def _corrupt(name: str, where: str, problem: str) -> ConfigurationError:
    return ConfigurationError(
        f"the token rank file of {name} at {where} is damaged: {problem}. Token counts from it could be "
        "too low, so it is not used; reinstall Sluice (pip install --force-reinstall 'sluice-queue[llm]')"
    )
