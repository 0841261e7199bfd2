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

Facts are extracted per prompt (:mod:`sluice.llm.prompt_facts`: cheap regexes, no models, over the
word lists of :mod:`sluice.llm.guard_words`), so they can be stored next to a cache
entry. Everything is deliberately conservative: a guard that is unsure vetoes, which costs one
provider call, never a wrong answer. English prompts only.

Usage::

    from sluice.llm.guards import check
    failed = check(new_prompt, cached_prompt)   # [] means the hit may be served
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from sluice.llm.guard_words import ANTONYMS, NEG_PREFIXES
from sluice.llm.prompt_facts import PromptFacts, extract

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


# ----------------------------------------------------------------------------- pairwise checks


def _entities_agree(a: PromptFacts, b: PromptFacts) -> bool:
    # each prompt's proper names must be mentioned (in any case) by the other
    return all(e in b.words for e in a.entities) and all(e in a.words for e in b.entities)


def _inflections(base: str) -> set[str]:
    stem = base[:-1] if base.endswith("e") else base
    return {base, base + "s", base + "es", base + "d", base + "ed", stem + "ing", stem + "ed"}


_ANTONYM_FORMS: tuple[tuple[frozenset[str], frozenset[str]], ...] = tuple(
    (frozenset(_inflections(x)), frozenset(_inflections(y))) for x, y in ANTONYMS
)


def _negation_agree(a: PromptFacts, b: PromptFacts) -> bool:
    if a.negation != b.negation:
        return False
    # a word of one prompt is a negatively prefixed word of the other: "mutable" / "immutable"
    for x, y in ((a.words, b.words), (b.words, a.words)):
        for w in x - y:
            for p in NEG_PREFIXES:
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
