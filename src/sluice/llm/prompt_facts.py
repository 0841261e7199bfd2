"""What one prompt says that embeddings blur: its facts, for the guards to compare.

Numbers, currencies and units with their direction, dates, proper names,
negation, the requested language, format and length, programming languages,
and the content words in order (:class:`PromptFacts`). :func:`extract` reads
them with cheap regexes (no models), so they can be stored next to a cache
entry; :mod:`sluice.llm.guards` compares two prompts' facts. The vocabularies
are :mod:`sluice.llm.guard_words`. English prompts only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.llm.guard_words import (
    AMBIGUOUS_UNITS,
    CASED_PROGLANGS,
    COUNT_WORDS,
    CURRENCY_CODES,
    CURRENCY_PHRASES,
    CURRENCY_SYMBOLS,
    CURRENCY_WORDS,
    FORMATS,
    GUARD_VOCAB,
    LANG_CUES,
    LANGUAGES,
    LENGTH_FILLERS,
    LENGTH_QUALITATIVE,
    LENGTH_UNITS,
    MONTH_ABBR,
    MONTHS,
    NEGATIONS,
    NOT_ENTITIES,
    NUMBER_WORDS,
    PROGLANGS,
    RELATIVE_DAYS,
    SENTENCE_BREAK,
    STOPWORDS,
    TIME_UNITS,
    UNIT_PHRASES,
    UNIT_WORDS,
    WEEKDAYS,
)

__all__ = ["PromptFacts", "extract"]

_TOKEN = re.compile(
    r"[A-Za-z][A-Za-z0-9_]*(?:['\u2019][A-Za-z]+)?(?:[-/.][A-Za-z0-9]+)*|\d[\d,]*(?:\.\d+)?(?:st|nd|rd|th|s)?|[$€£¥₹₩₿%]|[.!?:;]|\S"
)
_DIGITS = re.compile(r"\d[\d,]*(?:\.\d+)?")
_PRODUCT_NAME = re.compile(
    r"[a-z]+[A-Z][A-Za-z0-9]*|[A-Za-z][A-Za-z-]*\d[A-Za-z0-9-]*"
)  # iPhone, macOS, S23, WH-1000XM5
_HYPHEN_AMOUNT = re.compile(
    r"\b(\d[\d,.]*|" + "|".join(sorted(COUNT_WORDS, key=len, reverse=True)) + r")-([A-Za-z]+)", re.IGNORECASE
)
_PHRASE_SUBS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(rf"\b(?:{pat})\b", re.IGNORECASE), f" {iso} ") for pat, iso in CURRENCY_PHRASES
) + tuple(
    (re.compile(rf"(?<![A-Za-z])(?:{pat})", re.IGNORECASE), f" UNIT_{canon} ") for pat, canon in UNIT_PHRASES
)
_PROGLANG_RX: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(rf"(?<![\w+#-])(?:{pat})(?![\w+#])", re.IGNORECASE), canon) for pat, canon in PROGLANGS
)


@dataclass(frozen=True)
class PromptFacts:
    """What one prompt says that embeddings tend to blur. Comparable with ``==`` per field."""

    numbers: frozenset[str]
    currency: tuple[str, ...]
    units: tuple[str, ...]
    dates: frozenset[str]
    entities: tuple[str, ...]
    negation: int
    language: frozenset[str]
    format: frozenset[str]
    length: frozenset[str]
    proglang: frozenset[str]
    # supporting data for the pairwise checks (entities, negation prefixes, word order)
    words: frozenset[str]
    sequence: tuple[str, ...]


def _norm_number(raw: str) -> str | None:
    s = raw.lower().rstrip("s") if re.fullmatch(r"\d{4}s|\d0s", raw.lower()) else raw.lower()
    s = re.sub(r"(st|nd|rd|th)$", "", s).replace(",", "")
    try:
        value = float(s)
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def _words_to_number(words: Sequence[str]) -> int | None:
    """'twenty five' -> 25, 'two hundred' -> 200, 'ten' -> 10; None if not all number words."""
    total, current = 0, 0
    for w in words:
        if w not in NUMBER_WORDS:
            return None
        v = NUMBER_WORDS[w]
        if v in (100, 1000, 1_000_000, 1_000_000_000):
            current = max(current, 1) * v
            if v >= 1000:
                total, current = total + current, 0
        else:
            current += v
    return total + current


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def _sentence_starts(tokens: Sequence[str]) -> set[int]:
    starts = {0}
    for i, t in enumerate(tokens):
        if t in SENTENCE_BREAK or t.endswith(("'", '"')):
            starts.add(i + 1)
    return starts


def _numbers(tokens: Sequence[str]) -> frozenset[str]:
    out: set[str] = set()
    i = 0
    low = [t.lower() for t in tokens]
    while i < len(tokens):
        t = tokens[i]
        if t[0].isdigit():
            n = _norm_number(t)
            if n is not None:
                out.add(n)
            i += 1
            continue
        # number words, possibly hyphenated ("twenty-five", "ten-year-old") or multiword
        parts = re.split(r"-", low[i])
        head = [p for p in parts if p in NUMBER_WORDS]
        if head and parts[0] in NUMBER_WORDS:
            run = [p for p in parts if p in NUMBER_WORDS]
            j = i + 1
            while j < len(tokens) and low[j] in NUMBER_WORDS:
                run.append(low[j])
                j += 1
            value = _words_to_number(run)
            if value is not None:
                out.add(str(value))
            i = j
            continue
        i += 1
    return frozenset(out)


def _is_amount(tok: str) -> bool:
    low = tok.lower()
    return bool(re.fullmatch(r"\d[\d,]*(?:\.\d+)?", tok)) or low in NUMBER_WORDS or low in ("a", "an", "one")


def _directional(mentions: list[tuple[str, bool]], ordered_fallback: bool) -> tuple[str, ...]:
    """Canonical form of quantity conversions.

    A mention next to an amount ("100 USD", "$12", "a pound") is the source; the others are targets.
    With a source, order does not matter ("How many EUR is 100 USD" == "100 USD in EUR"). Without
    one, currencies keep their order ("GBP to JPY" vs "JPY to GBP"); units become a set.
    """
    if not mentions:
        return ()
    sources = sorted({c for c, amount in mentions if amount})
    targets = sorted({c for c, amount in mentions if not amount} - set(sources))
    if sources:
        return tuple(f"from:{c}" for c in sources) + tuple(f"to:{c}" for c in targets)
    if ordered_fallback:
        seq: list[str] = []
        for c, _ in mentions:
            if not seq or seq[-1] != c:
                seq.append(c)
        return tuple(f"seq:{c}" for c in seq)
    return tuple(f"any:{c}" for c in sorted({c for c, _ in mentions}))


def _currency_and_units(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:  # noqa: C901, PLR0912
    work = text
    for rx, replacement in _PHRASE_SUBS:
        work = rx.sub(replacement, work)
    toks = _tokens(work)
    low = [t.lower() for t in toks]
    codes_seen = {t for t in toks if t in CURRENCY_CODES}

    def near_amount(i: int) -> bool:
        before = toks[i - 1] if i > 0 else ""
        after = toks[i + 1] if i + 1 < len(toks) else ""
        return _is_amount(before) or bool(_DIGITS.fullmatch(after))

    cur: list[tuple[str, bool]] = []
    units: list[tuple[str, bool]] = []
    for i, t in enumerate(toks):
        parts = t.split("/")
        if len(parts) == 2 and all(p.upper() in CURRENCY_CODES for p in parts):  # "USD/CHF"
            cur += [(parts[0].upper(), False), (parts[1].upper(), False)]
            continue
        code: str | None = None
        if t in CURRENCY_CODES:
            # "PHP" is the peso only next to an amount or another currency; otherwise the language
            if t != "PHP" or near_amount(i) or len(codes_seen) > 1:
                code = t
        elif t in CURRENCY_SYMBOLS:
            code = CURRENCY_SYMBOLS[t]
        elif low[i] in CURRENCY_WORDS:
            code = CURRENCY_WORDS[low[i]]
        if code is not None:
            symbol_first = t in CURRENCY_SYMBOLS and i + 1 < len(toks) and toks[i + 1][0].isdigit()
            cur.append((code, near_amount(i) or symbol_first))
            if code != "POUND":  # "pound" is also a weight: let the unit branch see it too
                continue
        if t.startswith("UNIT_"):
            units.append((t[5:], near_amount(i)))
        elif low[i] in UNIT_WORDS:
            amount = near_amount(i)
            cue = i > 0 and low[i - 1] in ("in", "to", "into", "per")
            if low[i] in AMBIGUOUS_UNITS and not (amount or cue):
                continue
            units.append((UNIT_WORDS[low[i]], amount))
    # hyphenated amounts ("5-mile run", "two-litre bottle"); durations ("3-day trip") are counts, not units
    for m in _HYPHEN_AMOUNT.finditer(work):
        unit = UNIT_WORDS.get(m.group(2).lower())
        if unit and unit not in TIME_UNITS:
            units.append((unit, True))
    # a single time unit ("5 years old", "every 5 minutes") is a count, not a conversion
    if len({c for c, _ in units if c in TIME_UNITS}) < 2:
        units = [(c, a) for c, a in units if c not in TIME_UNITS]
    return _directional(cur, ordered_fallback=True), _directional(units, ordered_fallback=False)


def _dates(text: str, tokens: Sequence[str]) -> frozenset[str]:
    out: set[str] = set()
    starts = _sentence_starts(tokens)
    for i, t in enumerate(tokens):
        low = t.lower().rstrip(".")
        near_digit = any(j < len(tokens) and j >= 0 and tokens[j][0].isdigit() for j in (i - 1, i + 1))
        if low in MONTHS:
            # "may" and "march" are months only when capitalised, and off a sentence start or next to a number
            if low in ("may", "march") and not (t[0].isupper() and (i not in starts or near_digit)):
                continue
            out.add(f"month:{low}")
        elif low in MONTH_ABBR and t[0].isupper() and near_digit:
            out.add(f"month:{MONTH_ABBR[low]}")
        elif low.rstrip("s") in WEEKDAYS:
            out.add(f"weekday:{low.rstrip('s')}")
        elif low in RELATIVE_DAYS:
            out.add(f"rel:{low}")
    for m in re.finditer(r"\b(\d{2,4})0s\b|\b'(\d)0s\b", text):
        out.add(f"decade:{m.group(0).strip(chr(39))}")
    for m in re.finditer(r"\b(\d{1,2})(?:st|nd|rd|th) century\b", text, flags=re.IGNORECASE):
        out.add(f"century:{m.group(1)}")
    for m in re.finditer(
        r"\b(next|last|this|previous|coming) (week|month|year|quarter|weekend)\b", text, flags=re.IGNORECASE
    ):
        out.add(f"rel:{m.group(1).lower()}-{m.group(2).lower()}")
    for m in re.finditer(r"\b(\d{1,2}):(\d{2})\b|\b(\d{1,2}) ?([ap])\.?m\b", text, flags=re.IGNORECASE):
        out.add(
            "time:"
            + (f"{int(m.group(1))}:{m.group(2)}" if m.group(1) else f"{int(m.group(3))}{m.group(4).lower()}m")
        )
    return frozenset(out)


def _strip_possessive(t: str) -> str:
    return re.sub(r"['\u2019]s$", "", t)


def _entities(tokens: Sequence[str]) -> tuple[str, ...]:
    """Proper-name-like words in order of first mention: capitalised off a sentence start, or
    mixed-case/alphanumeric product names (iPhone, macOS, S23, WH-1000XM5)."""
    starts = _sentence_starts(tokens)
    out: list[str] = []
    for i, t in enumerate(tokens):
        if not t[0].isalpha():
            continue
        base = _strip_possessive(t)
        low = base.lower()
        if low in NOT_ENTITIES or low in GUARD_VOCAB or low in STOPWORDS:
            continue
        product = bool(_PRODUCT_NAME.fullmatch(base))
        capital = base[0].isupper() and i not in starts
        if (product or capital) and low not in out:
            out.append(low)
    return tuple(out)


def _language(tokens: Sequence[str]) -> frozenset[str]:
    low = [t.lower() for t in tokens]
    out: set[str] = set()
    for i, t in enumerate(low):
        if t in LANGUAGES:
            cue_before = i > 0 and (
                low[i - 1] in LANG_CUES
                or (
                    i > 1
                    and low[i - 2] in ("in", "into")
                    and low[i - 1] in ("only", "fluent", "plain", "simple")
                )
            )
            cue_after = i + 1 < len(low) and low[i + 1] in ("translation", "version", "text", "speakers")
            if cue_before or cue_after:
                out.add(t)
    return frozenset(out)


def _formats(text: str) -> frozenset[str]:
    low = text.lower()
    out = {canon for pat, canon in FORMATS if re.search(pat, low)}
    if re.search(r"\bbullet(?:ed)? points?\b", low):
        out.add("bullets")
    if re.search(r"\btweet-length\b", low):
        out.discard("tweet")
    return frozenset(out)


def _length(text: str) -> frozenset[str]:
    """Length limits as "unit:count" ("word:100", "sentence:3", "char:280") plus "qual:short/long"."""
    low = text.lower().replace("\u2019", "'")
    words = re.findall(r"\d[\d,]*|[a-z]+(?:'[a-z]+)?", re.sub(r"(?<=\w)-(?=\w)", " ", low))
    out: set[str] = set()
    spoken = bool(re.search(r"speech|pitch|toast|talk|presentation|podcast|video|script", low))
    for i, w in enumerate(words):
        unit = LENGTH_UNITS.get(w)
        if unit is None or i == 0:
            continue
        if unit in ("minute", "second") and not spoken:
            continue
        j = i - 1
        while j > 0 and words[j] in LENGTH_FILLERS:
            j -= 1
        count = words[j]
        if _DIGITS.fullmatch(count):
            out.add(f"{unit}:{int(count.replace(',', ''))}")
        elif count in COUNT_WORDS and (
            count not in ("a", "an") or unit in ("sentence", "paragraph", "page", "tweet")
        ):
            out.add(f"{unit}:{COUNT_WORDS[count]}")
        elif words[i - 1] in ("single", "one"):
            out.add(f"{unit}:1")
    if re.search(r"\btweet[- ]length\b|\bin a tweet\b", low):
        out.add("char:280")
    for w in words:
        if w in LENGTH_QUALITATIVE:
            out.add(f"qual:{LENGTH_QUALITATIVE[w]}")
    if re.search(r"\bin (?:great |more |full )?detail\b|\bin[- ]depth\b|\blong[- ]form\b", low):
        out.add("qual:long")
    return frozenset(out)


def _proglangs(text: str) -> frozenset[str]:
    out: set[str] = set()
    work = text
    for rx, canon in _PROGLANG_RX:
        if rx.search(work):
            out.add(canon)
            work = rx.sub(" ", work)
    for pat, canon in CASED_PROGLANGS:
        for m in re.finditer(pat, work):
            # "Go" at the very start is usually the verb ("Go through...") unless code words follow
            if (
                canon == "go"
                and m.start() == 0
                and not re.match(r"Go (function|code|program|script|snippet|module)", work)
            ):
                continue
            out.add(canon)
    return frozenset(out)


def _content_sequence(tokens: Sequence[str]) -> tuple[str, ...]:
    seq = []
    for t in tokens:
        if not (t[0].isalnum()):
            continue
        low = _strip_possessive(t.lower())
        if low in STOPWORDS:
            continue
        seq.append(low)
    return tuple(seq)


def extract(text: str) -> PromptFacts:
    """Facts of one prompt. Pure function of the text; cheap (regexes only)."""
    toks = _tokens(text)
    currency, units = _currency_and_units(text)
    words = frozenset(_strip_possessive(t.lower()) for t in toks if t[0].isalnum())
    negation = sum(1 for t in toks if t.lower() in NEGATIONS or t.lower().endswith(("n't", "n\u2019t")))
    proglang = _proglangs(text)
    if any(c.endswith(":PHP") for c in currency):  # "USD to PHP" is the Philippine peso
        proglang = proglang - {"php"}
    return PromptFacts(
        numbers=_numbers(toks),
        currency=currency,
        units=units,
        dates=_dates(text, toks),
        entities=_entities(toks),
        negation=negation,
        language=_language(toks),
        format=_formats(text),
        length=_length(text),
        proglang=proglang,
        words=words,
        sequence=_content_sequence(toks),
    )
