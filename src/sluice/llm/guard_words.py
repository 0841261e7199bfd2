"""The guards' vocabularies: number words, currencies, units, languages, formats, negations...

The lists themselves are data (``data/guards.json``), read once, at import;
this module gives each its type and says what it is for. What the guards do
with them is :mod:`sluice.llm.prompt_facts` (what one prompt says) and
:mod:`sluice.llm.guards` (whether two prompts say the same).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def _load() -> dict[str, Any]:
    raw = resources.files("sluice.llm").joinpath("data", "guards.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(raw)
    return data


_DATA = _load()


def _pairs(name: str) -> tuple[tuple[str, str], ...]:
    return tuple((a, b) for a, b in _DATA[name])


NUMBER_WORDS: dict[str, int] = dict(_DATA["number_words"])
# "one" and "a" are left out of plain numbers (pronoun/article); length limits read them.
COUNT_WORDS: dict[str, int] = {**NUMBER_WORDS, "one": 1, "a": 1, "an": 1, "single": 1}

MONTHS: tuple[str, ...] = tuple(_DATA["months"])
MONTH_ABBR = {m[:3]: m for m in MONTHS if m != "may"} | {"sept": "september"}
WEEKDAYS: tuple[str, ...] = tuple(_DATA["weekdays"])
RELATIVE_DAYS: tuple[str, ...] = tuple(_DATA["relative_days"])

# ISO codes (the common ones) and names/symbols mapped to a code; "POUND" is weight or sterling.
CURRENCY_CODES: frozenset[str] = frozenset(_DATA["currency_codes"])
CURRENCY_PHRASES: tuple[tuple[str, str], ...] = _pairs("currency_phrases")
CURRENCY_WORDS: dict[str, str] = dict(_DATA["currency_words"])
CURRENCY_SYMBOLS: dict[str, str] = dict(_DATA["currency_symbols"])

UNIT_PHRASES: tuple[tuple[str, str], ...] = _pairs("unit_phrases")
#: every form of a unit word -> its canonical name
UNIT_WORDS: dict[str, str] = {}
for _canon, _forms in _DATA["unit_forms"].items():
    for _form in _forms:
        UNIT_WORDS[_form] = _canon
# Unit words that are ordinary English too: they count only next to a number or after in/to/into.
AMBIGUOUS_UNITS: frozenset[str] = frozenset(_DATA["ambiguous_units"])
TIME_UNITS: frozenset[str] = frozenset(_DATA["time_units"])

LANGUAGES: frozenset[str] = frozenset(_DATA["languages"])
LANG_CUES: frozenset[str] = frozenset(_DATA["language_cues"])

FORMATS: tuple[tuple[str, str], ...] = _pairs("formats")

LENGTH_UNITS: dict[str, str] = dict(_DATA["length_units"])
LENGTH_QUALITATIVE: dict[str, str] = dict(_DATA["length_qualitative"])
LENGTH_FILLERS: frozenset[str] = frozenset(_DATA["length_fillers"])

# longest / most specific first; matched case-insensitively unless listed in CASED_PROGLANGS
PROGLANGS: tuple[tuple[str, str], ...] = _pairs("proglangs")
# Single letters and English words need their capitalisation: "Go", "R", "C", "PHP".
CASED_PROGLANGS: tuple[tuple[str, str], ...] = _pairs("cased_proglangs")

NEGATIONS: frozenset[str] = frozenset(_DATA["negations"])
# Opposites that a negation word does not mark ("accept" / "decline"); inflected forms are derived.
ANTONYMS: tuple[tuple[str, str], ...] = _pairs("antonyms")
NEG_PREFIXES: tuple[str, ...] = tuple(_DATA["negative_prefixes"])

STOPWORDS: frozenset[str] = frozenset(_DATA["stopwords"])
# Words that start sentences or are common enough that a capital letter means nothing.
NOT_ENTITIES: frozenset[str] = frozenset(_DATA["not_entities"])
SENTENCE_BREAK: frozenset[str] = frozenset(_DATA["sentence_breaks"])


def _guard_vocab() -> frozenset[str]:
    vocab = set(MONTHS) | set(WEEKDAYS) | LANGUAGES | {c.lower() for c in CURRENCY_CODES}
    vocab |= set(CURRENCY_WORDS) | set(UNIT_WORDS)
    vocab |= set(_DATA["known_terms"])  # programming languages and formats by name
    return frozenset(vocab)


#: words some guard reads for itself: never taken for a proper name
GUARD_VOCAB = _guard_vocab()
