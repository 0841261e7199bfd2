"""Failure fingerprints: what identifies a failure, whatever varies between its occurrences.

A job that ended badly is fingerprinted (:func:`fingerprint`): the first line
of its error (what the engine records is ``Name: message`` and then the
traceback) with what varies between occurrences masked (ids, numbers, paths,
URLs, addresses, quoted values), its error type and its job type. Jobs with
the same fingerprint in one tenant's queue are one pattern
(``store/patterns.py``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

#: Longest normalized message kept (a pattern is its first few hundred characters).
MAX_MESSAGE = 300


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What identifies a failure: ``id`` is a short stable hash of the queue, the job type,
    the error type and the normalized message. ``head`` is the raw first line (unmasked: the
    rules read status codes in it), ``message`` the same with its variable parts masked."""

    id: str
    job_type: str
    error_type: str
    message: str
    head: str


#: A class name at the start of the error, as the engine writes it (``Name: message``);
#: dotted names (``httpx.ReadTimeout``) keep their last part.
_PREFIX = re.compile(r"^((?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*))(?:\[[^\]\n]*\])?:(?:\s|$)")
#: A name in the text that is an exception class by its spelling.
_NAMED = re.compile(
    r"\b([A-Z][A-Za-z0-9]*(?:Error|Exception|Timeout|Throttled|Unavailable|Rejected|NotFound|Exhausted|Refused))\b"
)
_CLASS_LIKE = re.compile(r"^[A-Z]\w*$|(?:Error|Exception|Warning|Exit|Interrupt|Timeout)$")
#: Phrases of the engine's own errors that name no class.
_ENGINE_TYPES = ((re.compile(r"^no handler named\b"), "UnknownJobName"),)

_MASKS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+"), "<url>"),
    (re.compile(r"\b[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+\b"), "<email>"),
    (
        re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
        "<uuid>",
    ),
    (re.compile(r"(?<![\w.:])\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?(?![\w.])"), "<ip>"),
    (re.compile(r"(?<![\w:])(?:[0-9a-fA-F]{1,4}:){3,7}[0-9a-fA-F]{1,4}(?![\w:])"), "<ip>"),
    (re.compile(r"(?<![\w/<>.~-])(?:~|\.{1,2})?(?:/[\w.@%+=,-]+){2,}/?"), "<path>"),
    (re.compile(r"\b[A-Za-z]:\\[^\s'\"]+"), "<path>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<hex>"),
    (re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"), "<hex>"),
    (re.compile(r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[\w-]{16,}\b"), "<id>"),
)
_QUOTED = re.compile(r"""(?<!\w)(['"])([^'"\n]{0,200})\1(?!\w)""")
#: A quoted value kept as it is: a bare name (a key, a field, a handler), not a value. Two
#: ``KeyError: 'prompt'`` and ``KeyError: 'model'`` are two bugs; two user names are one.
_NAME = re.compile(r"^[A-Za-z_][A-Za-z_.:-]{0,59}$|^<\w+>$")
_NUMBER = re.compile(r"(?<![A-Za-z_<])\d+(?:[.,]\d+)*(?:[eE][-+]?\d+)?")
_SPACE = re.compile(r"\s+")


def error_head(error: str) -> str:
    """The first line of a recorded error, what identifies it: the engine writes ``Name:
    message`` then the traceback; a bare traceback ends with that line instead."""
    text = error.strip()
    marker = "Traceback (most recent call last):"
    at = text.find(marker)
    if at == 0:
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln[:1].isspace()]
        last = [ln for ln in lines if not ln.startswith(marker)]
        text = last[-1] if last else ""
    elif at > 0:
        text = text[:at]
    return _SPACE.sub(" ", text).strip()[:2000]


def _error_type(head: str, status: str | None) -> tuple[str, str]:
    """The error's class name and the rest of the head line."""
    found = _PREFIX.match(head)
    if found and _CLASS_LIKE.search(found.group(2)):
        return found.group(2), head[found.end() :].strip()
    if status == "EXHAUSTED":
        return "JobExhausted", head
    if status == "REJECTED":
        return "JobRejected", head
    for phrase, name in _ENGINE_TYPES:
        if phrase.search(head):
            return name, head
    named = _NAMED.search(head)
    return (named.group(1) if named else "Error"), head


def normalize(message: str) -> str:
    """The message with what varies between occurrences masked (``<url>``, ``<email>``,
    ``<uuid>``, ``<ip>``, ``<path>``, ``<hex>``, ``<id>``, ``<str>``, ``<num>``), its
    whitespace collapsed, at most ``MAX_MESSAGE`` characters."""
    out = message
    for pattern, mask in _MASKS:
        out = pattern.sub(mask, out)
    out = _QUOTED.sub(lambda m: m.group(0) if _NAME.match(m.group(2)) else "<str>", out)
    out = _NUMBER.sub("<num>", out)
    out = _SPACE.sub(" ", out).strip()
    return out if len(out) <= MAX_MESSAGE else out[: MAX_MESSAGE - 1] + "…"


def fingerprint(error: str, job_type: str, *, queue: str = "", status: str | None = None) -> Fingerprint:
    """The fingerprint of a job's recorded error.

    ``status`` names the error type of a rejection (``JobRejected``, ``JobExhausted``: their
    reason names no class). The id hashes the queue too, so that within a tenant an id names
    one pattern (the routes look patterns up by tenant and id).
    """
    head = error_head(error or "")
    error_type, rest = _error_type(head, status)
    message = normalize(rest) or "<empty>"
    digest = hashlib.sha256("\x1f".join((queue, job_type, error_type, message)).encode()).hexdigest()
    return Fingerprint(digest[:16], job_type, error_type, message, rest)
