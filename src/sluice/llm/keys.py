"""API keys, kept out of sight: read from the environment, held in a :class:`Secret`, scrubbed
from every message.

A provider keeps its key only in its client's headers and in a :class:`Secret` (whose repr
hides it), and every message taken from an answer or a transport error is scrubbed of it
before it becomes part of an exception: some servers echo the key they were sent. A URL in a
message is shown without its query and user:password (:func:`safe_url`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import httpx

from sluice.errors import ConfigurationError

#: The longest provider message repeated in ours.
MAX_MESSAGE_CHARS = 500
_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")


class Secret:
    """An API key that does not show itself: its repr and str are ``Secret('***')``."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


def read_key(
    env: Mapping[str, str], names: Sequence[str], *, provider: str, required: bool, hint: str = ""
) -> tuple[Secret | None, str | None]:
    """The key from the first of ``names`` set in ``env``, and that variable's name.

    Whitespace around it is dropped (a pasted newline is the usual mistake). A missing key is a
    :class:`~sluice.errors.ConfigurationError` naming the variable when ``required``; a key that
    an HTTP header cannot carry is one always. Neither message contains the key.
    """
    for name in names:
        value = env.get(name, "").strip()
        if not value:
            continue
        if not _HEADER_SAFE.fullmatch(value):
            raise ConfigurationError(
                f"{provider}: {name} holds characters an HTTP header cannot carry (spaces, line "
                "breaks or non-ASCII letters inside the key): set it again to the key exactly as the "
                "provider shows it"
            )
        return Secret(value), name
    if required:
        wanted = " (or ".join(names) + ")" * (len(names) - 1)
        raise ConfigurationError(
            f"{provider}: no API key: set {wanted} in the environment to the provider's API key" + hint
        )
    return None, None


def safe_url(url: httpx.URL | str) -> str:
    """``url`` without its query and user:password: what an error message may show."""
    try:
        u = httpx.URL(str(url))
    except httpx.InvalidURL:
        return "(an invalid URL)"
    port = f":{u.port}" if u.port is not None else ""
    return f"{u.scheme}://{u.host}{port}{u.path}"


def redact(text: str, secrets: Sequence[Secret]) -> str:
    """``text`` with every secret replaced by ``[redacted]``, at its full length."""
    for secret in secrets:
        text = text.replace(secret.reveal(), "[redacted]")
    return text


def scrub(text: str, secrets: Sequence[Secret]) -> str:
    """``text`` with every secret replaced, then shortened to :data:`MAX_MESSAGE_CHARS`.

    In that order: shortening first could cut a key in two, and the half before the cut would
    no longer match the key and stay in the message.
    """
    text = " ".join(redact(text, secrets).split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."
