"""Guards for a semantic prompt cache: veto embedding hits that differ in what embeddings blur.

An embedding puts "Convert 100 USD to EUR" and "Convert 100 EUR to USD" at cosine ~0.97-1.0, and
"in French" next to "in German". After the nearest cached prompt passes the similarity threshold,
these guards compare the two prompts' *facts* and allow the hit only when every guard agrees:

    numbers       numeric values, digits or number words ("10", "ten", "10,000", "15%")
    currency      currencies, with direction ("100 USD to EUR" is not "100 EUR to USD")
    units         measurement units, with direction ("5 miles to km" is not "5 km to miles")
    dates         months, weekdays, decades, centuries, relative days
    entities      proper names (capitalised words not at a sentence start, mixed-case tokens)
    negation      negation words, un-/in-/dis-/non- prefixed opposites, a short list of antonyms
    language      requested natural language ("in French", "into German", "reply in Chinese")
    format        requested output format (JSON, YAML, table, bullet list, CSV, haiku...)
    length        length limits ("in 50 words", "three sentences", "briefly", "in detail")
    proglang      programming languages ("in Python", "Rust function")
    word_order    same words or names in a different order, i.e. swapped roles ("from A to B" / "from B to A")

Facts are extracted per prompt (cheap regexes, no models), so they can be stored next to a cache
entry. Everything is deliberately conservative: a guard that is unsure vetoes, which costs one
provider call, never a wrong answer. English prompts only.

Usage::

    from guards import check
    failed = check(new_prompt, cached_prompt)   # [] means the hit may be served
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["GUARDS", "PromptFacts", "check", "extract", "is_safe_hit"]

GUARDS: tuple[str, ...] = (
    "numbers",
    "currency",
    "units",
    "dates",
    "entities",
    "negation",
    "language",
    "format",
    "length",
    "proglang",
    "word_order",
)

# ----------------------------------------------------------------------------- vocabularies

_NUMBER_WORDS: dict[str, int] = {
    "zero": 0,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "thirteen": 13,
    "fourteen": 14,
    "fifteen": 15,
    "sixteen": 16,
    "seventeen": 17,
    "eighteen": 18,
    "nineteen": 19,
    "twenty": 20,
    "thirty": 30,
    "forty": 40,
    "fifty": 50,
    "sixty": 60,
    "seventy": 70,
    "eighty": 80,
    "ninety": 90,
    "hundred": 100,
    "thousand": 1000,
    "million": 1_000_000,
    "billion": 1_000_000_000,
    "dozen": 12,
}
# "one" and "a" are left out of plain numbers (pronoun/article); length limits read them.
_COUNT_WORDS: dict[str, int] = {**_NUMBER_WORDS, "one": 1, "a": 1, "an": 1, "single": 1}

_MONTHS = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
_MONTH_ABBR = {m[:3]: m for m in _MONTHS if m != "may"} | {"sept": "september"}
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_RELATIVE_DAYS = ("today", "tonight", "tomorrow", "yesterday", "weekend")

# ISO codes (the common ones) and names/symbols mapped to a code; "POUND" is weight or sterling.
_CURRENCY_CODES = frozenset(
    [
        "USD",
        "EUR",
        "GBP",
        "JPY",
        "CHF",
        "CAD",
        "AUD",
        "NZD",
        "CNY",
        "RMB",
        "HKD",
        "SGD",
        "INR",
        "KRW",
        "SEK",
        "NOK",
        "DKK",
        "PLN",
        "CZK",
        "HUF",
        "MXN",
        "BRL",
        "ARS",
        "CLP",
        "COP",
        "PHP",
        "ZAR",
        "TRY",
        "RUB",
        "UAH",
        "ILS",
        "AED",
        "SAR",
        "THB",
        "IDR",
        "MYR",
        "VND",
        "NGN",
        "KES",
        "EGP",
        "BTC",
        "ETH",
        "USDT",
    ]
)
_CURRENCY_PHRASES: tuple[tuple[str, str], ...] = (
    (r"canadian dollars?", "CAD"),
    (r"australian dollars?", "AUD"),
    (r"new zealand dollars?", "NZD"),
    (r"hong kong dollars?", "HKD"),
    (r"singapore dollars?", "SGD"),
    (r"u\.?s\.? dollars?", "USD"),
    (r"swiss francs?", "CHF"),
    (r"mexican pesos?", "MXN"),
    (r"philippine pesos?", "PHP"),
    (r"japanese yen", "JPY"),
    (r"chinese yuan", "CNY"),
    (r"indian rupees?", "INR"),
    (r"(?:south )?korean won", "KRW"),
    (r"british pounds?|pounds? sterling", "GBP"),
    (r"swedish kronor|swedish krona", "SEK"),
    (r"norwegian kroner|norwegian krone", "NOK"),
)
_CURRENCY_WORDS: dict[str, str] = {
    "dollar": "USD",
    "dollars": "USD",
    "euro": "EUR",
    "euros": "EUR",
    "yen": "JPY",
    "yuan": "CNY",
    "renminbi": "CNY",
    "rupee": "INR",
    "rupees": "INR",
    "peso": "PESO",
    "pesos": "PESO",
    "franc": "CHF",
    "francs": "CHF",
    "bitcoin": "BTC",
    "ether": "ETH",
    "ethereum": "ETH",
    "pound": "POUND",
    "pounds": "POUND",
    "sterling": "GBP",
}
_CURRENCY_SYMBOLS: dict[str, str] = {
    "$": "USD",
    "€": "EUR",
    "£": "GBP",
    "¥": "JPY",
    "₹": "INR",
    "₩": "KRW",
    "₿": "BTC",
}

_UNIT_PHRASES: tuple[tuple[str, str], ...] = (
    (r"square (?:feet|foot|ft)", "sq_ft"),
    (r"square (?:meters?|metres?)", "sq_m"),
    (r"square (?:kilometers?|kilometres?|km)", "sq_km"),
    (r"square miles?", "sq_mi"),
    (r"degrees? (?:celsius|centigrade)|°\s?c\b|ºc\b", "celsius"),
    (r"degrees? fahrenheit|°\s?f\b|ºf\b", "fahrenheit"),
    (r"km/h|kph|kilometers? per hour|kilometres? per hour", "km_per_h"),
    (r"mph|miles? per hour", "mph"),
    (r"miles? per gallon|mpg", "mpg"),
)
_UNIT_WORDS: dict[str, str] = {}
for _canon, _forms in {
    "mile": "mile miles mi",
    "km": "km kilometer kilometers kilometre kilometres",
    "m": "meter meters metre metres",
    "cm": "cm centimeter centimeters centimetre centimetres",
    "mm": "mm millimeter millimeters millimetre millimetres",
    "ft": "ft foot feet",
    "inch": "inch inches",
    "yard": "yard yards",
    "oz": "oz ounce ounces",
    "POUND": "pound pounds lb lbs",
    "g": "g gram grams gramme grammes",
    "kg": "kg kilogram kilograms kilo kilos",
    "stone": "stone stones",
    "ton": "ton tons tonne tonnes",
    "l": "l liter liters litre litres",
    "ml": "ml milliliter milliliters millilitre millilitres",
    "gallon": "gallon gallons gal",
    "cup": "cup cups",
    "tsp": "tsp teaspoon teaspoons",
    "tbsp": "tbsp tablespoon tablespoons",
    "acre": "acre acres",
    "hectare": "hectare hectares ha",
    "celsius": "celsius centigrade",
    "fahrenheit": "fahrenheit",
    "kelvin": "kelvin",
    "w": "w watt watts",
    "kw": "kw kilowatt kilowatts",
    "kwh": "kwh",
    "hp": "hp horsepower",
    "psi": "psi",
    "kpa": "kpa",
    "pa": "pascal pascals",
    "bar": "bar bars",
    "atm": "atm",
    "byte": "byte bytes",
    "kb": "kb kilobyte kilobytes",
    "kib": "kib kibibyte kibibytes",
    "mb": "mb megabyte megabytes",
    "gb": "gb gigabyte gigabytes",
    "tb": "tb terabyte terabytes",
    "s": "second seconds sec secs",
    "min": "minute minutes mins",
    "h": "hour hours hr hrs",
    "day": "day days",
    "week": "week weeks",
    "month": "month months",
    "year": "year years",
    "calorie": "calorie calories kcal",
    "joule": "joule joules",
}.items():
    for _form in _forms.split():
        _UNIT_WORDS[_form] = _canon
# Unit words that are ordinary English too: they count only next to a number or after in/to/into.
_AMBIGUOUS_UNITS = frozenset(
    {
        "m",
        "g",
        "l",
        "w",
        "s",
        "ha",
        "bar",
        "bars",
        "pa",
        "mi",
        "gal",
        "min",
        "second",
        "day",
        "days",
        "week",
        "weeks",
        "month",
        "months",
        "year",
        "years",
        "h",
    }
)

_LANGUAGES = frozenset(
    [
        "english",
        "french",
        "german",
        "spanish",
        "italian",
        "portuguese",
        "dutch",
        "flemish",
        "polish",
        "czech",
        "slovak",
        "swedish",
        "norwegian",
        "danish",
        "finnish",
        "icelandic",
        "greek",
        "turkish",
        "russian",
        "ukrainian",
        "belarusian",
        "romanian",
        "bulgarian",
        "serbian",
        "croatian",
        "bosnian",
        "slovenian",
        "hungarian",
        "estonian",
        "latvian",
        "lithuanian",
        "arabic",
        "hebrew",
        "persian",
        "farsi",
        "urdu",
        "hindi",
        "bengali",
        "punjabi",
        "gujarati",
        "marathi",
        "tamil",
        "telugu",
        "kannada",
        "malayalam",
        "chinese",
        "mandarin",
        "cantonese",
        "japanese",
        "korean",
        "vietnamese",
        "thai",
        "indonesian",
        "malay",
        "tagalog",
        "filipino",
        "swahili",
        "amharic",
        "yoruba",
        "zulu",
        "latin",
        "esperanto",
        "catalan",
        "basque",
        "galician",
        "welsh",
        "irish",
    ]
)
_LANG_CUES = frozenset({"in", "into", "to", "from"})

_FORMATS: tuple[tuple[str, str], ...] = (
    (r"\bjson\b", "json"),
    (r"\bya?ml\b", "yaml"),
    (r"\bxml\b", "xml"),
    (r"\bcsv\b", "csv"),
    (r"\btsv\b", "tsv"),
    (r"\bmarkdown\b", "markdown"),
    (r"\bhtml\b", "html"),
    (r"\blatex\b", "latex"),
    (r"\btables?\b|\btabular\b", "table"),
    (r"\bbullet(?:ed)?\b|\bbullets\b", "bullets"),
    (r"\bnumbered\b", "numbered"),
    (r"\bchecklist\b", "checklist"),
    (r"\bprose\b", "prose"),
    (r"\bhaikus?\b", "haiku"),
    (r"\blimericks?\b", "limerick"),
    (r"\bsonnets?\b", "sonnet"),
    (r"\bmermaid\b|\bgantt\b", "diagram"),
    (r"\bflowchart\b|\bdiagram\b", "diagram"),
    (r"\bopenapi\b|\bswagger\b", "openapi"),
    (r"\bapa\b", "apa"),
    (r"\bmla\b", "mla"),
    (r"\bchicago style\b", "chicago"),
    (r"\bcode block\b", "code_block"),
    (r"\bemoji", "emoji"),
    (r"\bslides?\b|\bslide deck\b", "slides"),
    (r"\bq&a\b|\bfaq\b", "faq"),
    (r"\boutline\b", "outline"),
    (r"\bpoem\b", "poem"),
    (r"\btweet\b", "tweet"),
)

_LENGTH_UNITS: dict[str, str] = {
    "word": "word",
    "words": "word",
    "sentence": "sentence",
    "sentences": "sentence",
    "paragraph": "paragraph",
    "paragraphs": "paragraph",
    "page": "page",
    "pages": "page",
    "character": "char",
    "characters": "char",
    "chars": "char",
    "line": "line",
    "lines": "line",
    "bullet": "bullet",
    "bullets": "bullet",
    "point": "bullet",
    "points": "bullet",
    "items": "item",
    "minute": "minute",
    "minutes": "minute",
    "second": "second",
    "seconds": "second",
    "tweet": "tweet",
}
_LENGTH_QUALITATIVE: dict[str, str] = {
    "short": "short",
    "shorter": "short",
    "brief": "short",
    "briefly": "short",
    "concise": "short",
    "concisely": "short",
    "tl;dr": "short",
    "detailed": "long",
    "detail": "long",
    "depth": "long",
    "thorough": "long",
    "thoroughly": "long",
    "comprehensive": "long",
    "exhaustive": "long",
    "lengthy": "long",
}

_PROGLANGS: tuple[tuple[str, str], ...] = (
    # longest / most specific first; matched case-insensitively unless noted in _CASED_PROGLANGS
    (r"objective-c", "objective-c"),
    (r"c\+\+|cpp", "c++"),
    (r"c#|c-sharp|csharp", "c#"),
    (r"f#", "f#"),
    (r"typescript", "typescript"),
    (r"javascript|node\.?js|nodejs", "javascript"),
    (r"python", "python"),
    (r"java", "java"),
    (r"golang", "go"),
    (r"rust", "rust"),
    (r"ruby", "ruby"),
    (r"perl", "perl"),
    (r"swift", "swift"),
    (r"kotlin", "kotlin"),
    (r"scala", "scala"),
    (r"haskell", "haskell"),
    (r"julia", "julia"),
    (r"powershell", "powershell"),
    (r"bash|zsh|shell script", "shell"),
    (r"sql|postgresql dialect", "sql"),
    (r"lua", "lua"),
    (r"dart", "dart"),
    (r"elixir", "elixir"),
    (r"erlang", "erlang"),
    (r"clojure", "clojure"),
    (r"ocaml", "ocaml"),
    (r"matlab", "matlab"),
    (r"fortran", "fortran"),
    (r"cobol", "cobol"),
    (r"zig", "zig"),
    (r"nim", "nim"),
    (r"visual basic|vb\.net|vba", "vb"),
    (r"assembly|asm", "assembly"),
    (r"solidity", "solidity"),
)
# Single letters and English words need their capitalisation: "Go", "R", "C", "PHP".
_CASED_PROGLANGS: tuple[tuple[str, str], ...] = (
    (r"(?<![\w.])Go(?![\w#+])", "go"),
    (r"(?<![\w.])R(?![\w#+'])", "r"),
    (r"(?<![\w.°])C(?![\w#+'])", "c"),
    (r"(?<![\w.])PHP(?!\w)", "php"),
)

_NEGATIONS = frozenset(
    {
        "not",
        "no",
        "never",
        "without",
        "none",
        "nor",
        "neither",
        "nobody",
        "nothing",
        "nowhere",
        "cannot",
        "except",
        "excluding",
        "exclude",
        "against",
        "lacking",
    }
)
# Opposites that a negation word does not mark ("accept" / "decline"); inflected forms are derived.
_ANTONYMS: tuple[tuple[str, str], ...] = (
    ("enable", "disable"),
    ("accept", "decline"),
    ("accept", "reject"),
    ("allow", "deny"),
    ("allow", "block"),
    ("include", "exclude"),
    ("add", "remove"),
    ("increase", "decrease"),
    ("buy", "sell"),
    ("encrypt", "decrypt"),
    ("import", "export"),
    ("upload", "download"),
    ("push", "pull"),
    ("before", "after"),
    ("above", "below"),
    ("more", "less"),
    ("maximum", "minimum"),
    ("max", "min"),
    ("upper", "lower"),
    ("start", "stop"),
    ("open", "close"),
    ("true", "false"),
    ("success", "failure"),
    ("win", "lose"),
    ("pros", "cons"),
    ("advantage", "disadvantage"),
    ("best", "worst"),
    ("cheap", "expensive"),
    ("fast", "slow"),
    ("increment", "decrement"),
    ("ascending", "descending"),
    ("first", "last"),
    ("oldest", "newest"),
    ("largest", "smallest"),
    ("highest", "lowest"),
    ("hire", "fire"),
    ("join", "leave"),
    ("for", "against"),
)
_NEG_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "non-", "de", "anti")

_STOPWORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "this",
        "that",
        "these",
        "those",
        "my",
        "your",
        "his",
        "her",
        "their",
        "our",
        "its",
        "me",
        "i",
        "you",
        "he",
        "she",
        "they",
        "we",
        "it",
        "some",
        "any",
        "please",
        "kindly",
        "just",
        "also",
        "very",
        "really",
        "can",
        "could",
        "would",
        "should",
        "will",
        "do",
        "does",
        "did",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "am",
        "have",
        "has",
        "had",
        "there",
        "here",
        "so",
        "and",
        "or",
        "but",
        "if",
        "then",
        "than",
        "as",
        "at",
    ]
)
# Words that start sentences or are common enough that a capital letter means nothing.
_NOT_ENTITIES = frozenset(
    [
        "i",
        "i'm",
        "i've",
        "i'd",
        "i'll",
        "ok",
        "okay",
        "eli5",
        "tl",
        "dr",
        "tl;dr",
        "vs",
        "faq",
        "q&a",
        "ai",
        "api",
        "apis",
        "url",
        "urls",
        "http",
        "https",
        "id",
        "ids",
        "usa",
        "us",
        "uk",
        "eu",
    ]
)

_TOKEN = re.compile(
    r"[A-Za-z][A-Za-z0-9_]*(?:['\u2019][A-Za-z]+)?(?:[-/.][A-Za-z0-9]+)*|\d[\d,]*(?:\.\d+)?(?:st|nd|rd|th|s)?|[$€£¥₹₩₿%]|[.!?:;]|\S"
)
_DIGITS = re.compile(r"\d[\d,]*(?:\.\d+)?")
_PRODUCT_NAME = re.compile(
    r"[a-z]+[A-Z][A-Za-z0-9]*|[A-Za-z][A-Za-z-]*\d[A-Za-z0-9-]*"
)  # iPhone, macOS, S23, WH-1000XM5
_HYPHEN_AMOUNT = re.compile(
    r"\b(\d[\d,.]*|" + "|".join(sorted(_COUNT_WORDS, key=len, reverse=True)) + r")-([A-Za-z]+)", re.IGNORECASE
)
_TIME_UNITS = frozenset({"s", "min", "h", "day", "week", "month", "year"})
_LENGTH_FILLERS = frozenset(
    {
        "full",
        "short",
        "long",
        "brief",
        "bullet",
        "bulleted",
        "numbered",
        "single",
        "concise",
        "detailed",
        "complete",
        "whole",
        "more",
        "than",
        "max",
        "maximum",
    }
)
_SENTENCE_BREAK = frozenset({".", "!", "?", ":", ";", '"', "'", "\u201c", "\u2018", "(", "-", "\u2014"})


_PHRASE_SUBS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(rf"\b(?:{pat})\b", re.IGNORECASE), f" {iso} ") for pat, iso in _CURRENCY_PHRASES
) + tuple(
    (re.compile(rf"(?<![A-Za-z])(?:{pat})", re.IGNORECASE), f" UNIT_{canon} ") for pat, canon in _UNIT_PHRASES
)
_PROGLANG_RX: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(rf"(?<![\w+#-])(?:{pat})(?![\w+#])", re.IGNORECASE), canon) for pat, canon in _PROGLANGS
)


# ----------------------------------------------------------------------------- facts


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
        if w not in _NUMBER_WORDS:
            return None
        v = _NUMBER_WORDS[w]
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
        if t in _SENTENCE_BREAK or t.endswith(("'", '"')):
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
        head = [p for p in parts if p in _NUMBER_WORDS]
        if head and parts[0] in _NUMBER_WORDS:
            run = [p for p in parts if p in _NUMBER_WORDS]
            j = i + 1
            while j < len(tokens) and low[j] in _NUMBER_WORDS:
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
    return bool(re.fullmatch(r"\d[\d,]*(?:\.\d+)?", tok)) or low in _NUMBER_WORDS or low in ("a", "an", "one")


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
    codes_seen = {t for t in toks if t in _CURRENCY_CODES}

    def near_amount(i: int) -> bool:
        before = toks[i - 1] if i > 0 else ""
        after = toks[i + 1] if i + 1 < len(toks) else ""
        return _is_amount(before) or bool(_DIGITS.fullmatch(after))

    cur: list[tuple[str, bool]] = []
    units: list[tuple[str, bool]] = []
    for i, t in enumerate(toks):
        parts = t.split("/")
        if len(parts) == 2 and all(p.upper() in _CURRENCY_CODES for p in parts):  # "USD/CHF"
            cur += [(parts[0].upper(), False), (parts[1].upper(), False)]
            continue
        code: str | None = None
        if t in _CURRENCY_CODES:
            # "PHP" is the peso only next to an amount or another currency; otherwise the language
            if t != "PHP" or near_amount(i) or len(codes_seen) > 1:
                code = t
        elif t in _CURRENCY_SYMBOLS:
            code = _CURRENCY_SYMBOLS[t]
        elif low[i] in _CURRENCY_WORDS:
            code = _CURRENCY_WORDS[low[i]]
        if code is not None:
            symbol_first = t in _CURRENCY_SYMBOLS and i + 1 < len(toks) and toks[i + 1][0].isdigit()
            cur.append((code, near_amount(i) or symbol_first))
            if code != "POUND":  # "pound" is also a weight: let the unit branch see it too
                continue
        if t.startswith("UNIT_"):
            units.append((t[5:], near_amount(i)))
        elif low[i] in _UNIT_WORDS:
            amount = near_amount(i)
            cue = i > 0 and low[i - 1] in ("in", "to", "into", "per")
            if low[i] in _AMBIGUOUS_UNITS and not (amount or cue):
                continue
            units.append((_UNIT_WORDS[low[i]], amount))
    # hyphenated amounts ("5-mile run", "two-litre bottle"); durations ("3-day trip") are counts, not units
    for m in _HYPHEN_AMOUNT.finditer(work):
        unit = _UNIT_WORDS.get(m.group(2).lower())
        if unit and unit not in _TIME_UNITS:
            units.append((unit, True))
    # a single time unit ("5 years old", "every 5 minutes") is a count, not a conversion
    if len({c for c, _ in units if c in _TIME_UNITS}) < 2:
        units = [(c, a) for c, a in units if c not in _TIME_UNITS]
    return _directional(cur, ordered_fallback=True), _directional(units, ordered_fallback=False)


def _dates(text: str, tokens: Sequence[str]) -> frozenset[str]:
    out: set[str] = set()
    starts = _sentence_starts(tokens)
    for i, t in enumerate(tokens):
        low = t.lower().rstrip(".")
        near_digit = any(j < len(tokens) and j >= 0 and tokens[j][0].isdigit() for j in (i - 1, i + 1))
        if low in _MONTHS:
            # "may" and "march" are months only when capitalised, and off a sentence start or next to a number
            if low in ("may", "march") and not (t[0].isupper() and (i not in starts or near_digit)):
                continue
            out.add(f"month:{low}")
        elif low in _MONTH_ABBR and t[0].isupper() and near_digit:
            out.add(f"month:{_MONTH_ABBR[low]}")
        elif low.rstrip("s") in _WEEKDAYS:
            out.add(f"weekday:{low.rstrip('s')}")
        elif low in _RELATIVE_DAYS:
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


def _guard_vocab() -> frozenset[str]:
    vocab = set(_MONTHS) | set(_WEEKDAYS) | _LANGUAGES | {c.lower() for c in _CURRENCY_CODES}
    vocab |= set(_CURRENCY_WORDS) | set(_UNIT_WORDS)
    vocab |= {
        "python",
        "java",
        "javascript",
        "typescript",
        "rust",
        "ruby",
        "perl",
        "swift",
        "kotlin",
        "scala",
        "haskell",
        "julia",
        "powershell",
        "bash",
        "sql",
        "go",
        "golang",
        "php",
        "c",
        "r",
        "c++",
        "c#",
        "node.js",
        "lua",
        "dart",
        "json",
        "yaml",
        "xml",
        "csv",
        "html",
        "markdown",
        "apa",
        "mla",
        "openapi",
        "mermaid",
        "gantt",
        "celsius",
        "fahrenheit",
    }
    return frozenset(vocab)


_GUARD_VOCAB = _guard_vocab()


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
        if low in _NOT_ENTITIES or low in _GUARD_VOCAB or low in _STOPWORDS:
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
        if t in _LANGUAGES:
            cue_before = i > 0 and (
                low[i - 1] in _LANG_CUES
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
    out = {canon for pat, canon in _FORMATS if re.search(pat, low)}
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
        unit = _LENGTH_UNITS.get(w)
        if unit is None or i == 0:
            continue
        if unit in ("minute", "second") and not spoken:
            continue
        j = i - 1
        while j > 0 and words[j] in _LENGTH_FILLERS:
            j -= 1
        count = words[j]
        if _DIGITS.fullmatch(count):
            out.add(f"{unit}:{int(count.replace(',', ''))}")
        elif count in _COUNT_WORDS and (
            count not in ("a", "an") or unit in ("sentence", "paragraph", "page", "tweet")
        ):
            out.add(f"{unit}:{_COUNT_WORDS[count]}")
        elif words[i - 1] in ("single", "one"):
            out.add(f"{unit}:1")
    if re.search(r"\btweet[- ]length\b|\bin a tweet\b", low):
        out.add("char:280")
    for w in words:
        if w in _LENGTH_QUALITATIVE:
            out.add(f"qual:{_LENGTH_QUALITATIVE[w]}")
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
    for pat, canon in _CASED_PROGLANGS:
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
        if low in _STOPWORDS:
            continue
        seq.append(low)
    return tuple(seq)


def extract(text: str) -> PromptFacts:
    """Facts of one prompt. Pure function of the text; cheap (regexes only)."""
    toks = _tokens(text)
    currency, units = _currency_and_units(text)
    words = frozenset(_strip_possessive(t.lower()) for t in toks if t[0].isalnum())
    negation = sum(1 for t in toks if t.lower() in _NEGATIONS or t.lower().endswith(("n't", "n\u2019t")))
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


# ----------------------------------------------------------------------------- pairwise checks


def _entities_agree(a: PromptFacts, b: PromptFacts) -> bool:
    # each prompt's proper names must be mentioned (in any case) by the other
    return all(e in b.words for e in a.entities) and all(e in a.words for e in b.entities)


def _inflections(base: str) -> set[str]:
    stem = base[:-1] if base.endswith("e") else base
    return {base, base + "s", base + "es", base + "d", base + "ed", stem + "ing", stem + "ed"}


_ANTONYM_FORMS: tuple[tuple[frozenset[str], frozenset[str]], ...] = tuple(
    (frozenset(_inflections(x)), frozenset(_inflections(y))) for x, y in _ANTONYMS
)


def _negation_agree(a: PromptFacts, b: PromptFacts) -> bool:
    if a.negation != b.negation:
        return False
    # a word of one prompt is a negatively prefixed word of the other: "mutable" / "immutable"
    for x, y in ((a.words, b.words), (b.words, a.words)):
        for w in x - y:
            for p in _NEG_PREFIXES:
                if w.startswith(p) and len(w) - len(p) >= 4 and w[len(p) :] in y:
                    return False
    # antonyms: one prompt says "enable", the other "disable" (and neither says both)
    for pos, neg in _ANTONYM_FORMS:
        side_a = (bool(a.words & pos), bool(a.words & neg))
        side_b = (bool(b.words & pos), bool(b.words & neg))
        if any(side_a) and any(side_b) and side_a != side_b:
            return False
    return True


def _is_single_block_move(x: Sequence[str], y: Sequence[str]) -> bool:
    """True if y is x with one contiguous block cut out and re-inserted elsewhere."""
    if len(x) != len(y) or len(x) > 80:
        return False
    lo, hi = 0, len(x)
    while lo < hi and x[lo] == y[lo]:
        lo += 1
    while hi > lo and x[hi - 1] == y[hi - 1]:
        hi -= 1
    xs, ys = list(x[lo:hi]), list(y[lo:hi])
    return any(xs[k:] + xs[:k] == ys for k in range(1, len(xs)))


def _word_order_agree(a: PromptFacts, b: PromptFacts) -> bool:
    """Veto reorderings that swap roles.

    * the same content words in another order, unless one block just moved ("In one sentence,
      summarise X" == "Summarise X in one sentence"), e.g. "from the server to my laptop" vs
      "from my laptop to the server";
    * the same names mentioned in another order ("Does Alice owe Bob..." vs "Does Bob owe Alice...").
    """
    if len(a.entities) > 1 and set(a.entities) == set(b.entities) and a.entities != b.entities:
        return False
    if a.sequence == b.sequence or Counter(a.sequence) != Counter(b.sequence):
        return True
    return _is_single_block_move(a.sequence, b.sequence)


def _failures(a: PromptFacts, b: PromptFacts) -> list[str]:
    failed = []
    if a.numbers != b.numbers:
        failed.append("numbers")
    if a.currency != b.currency:
        failed.append("currency")
    if a.units != b.units:
        failed.append("units")
    if a.dates != b.dates:
        failed.append("dates")
    if not _entities_agree(a, b):
        failed.append("entities")
    if not _negation_agree(a, b):
        failed.append("negation")
    if a.language != b.language:
        failed.append("language")
    if a.format != b.format:
        failed.append("format")
    if a.length != b.length:
        failed.append("length")
    if a.proglang != b.proglang:
        failed.append("proglang")
    if not _word_order_agree(a, b):
        failed.append("word_order")
    return failed


def check(a: str | PromptFacts, b: str | PromptFacts, guards: Iterable[str] = GUARDS) -> list[str]:
    """Names of the guards (among ``guards``) that veto treating ``a`` and ``b`` as the same prompt."""
    fa = a if isinstance(a, PromptFacts) else extract(a)
    fb = b if isinstance(b, PromptFacts) else extract(b)
    wanted = set(guards)
    return [g for g in _failures(fa, fb) if g in wanted]


def is_safe_hit(a: str | PromptFacts, b: str | PromptFacts) -> bool:
    """True when no guard objects: the cached answer for ``b`` may be served for ``a``."""
    return not check(a, b)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3:
        print(extract(sys.argv[1]))
        print(extract(sys.argv[2]))
        print("vetoed by:", check(sys.argv[1], sys.argv[2]) or "nothing")
