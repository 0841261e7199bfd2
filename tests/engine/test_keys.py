"""The key layout is described once, in docs/architecture.md, and every key the engine builds is there."""

from __future__ import annotations

import dataclasses
import re

from sluice.engine.keys import QueueKeys
from tests.harness.proc_harness import REPO


def documented() -> set[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Keys") : text.index("## Lifecycle")]
    return set(re.findall(r"^\| `<prefix>:\{q\}:([a-z]+:?)", section, re.MULTILINE))


def test_every_key_the_engine_builds_is_documented() -> None:
    keys = QueueKeys.for_queue("q", "p")
    built = set()
    for field in dataclasses.fields(keys):
        value = getattr(keys, field.name)
        if field.name == "base":
            continue
        assert value.startswith("p:{q}:"), (field.name, value)
        built.add(value.removeprefix("p:{q}:"))
    assert built == documented()
