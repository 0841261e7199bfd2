"""Loopback servers that speak Anthropic's and Gemini's protocols, for testing their clients.

Like the OpenAI-compatible :mod:`sluice.testing.provider` (whose window, faults, prefix cache,
control routes and process plumbing they share), each is a real HTTP server in a process of
its own, answering the small part of its provider's API a queue needs, in that provider's
shapes: :class:`~sluice.testing.anthropic_server.AnthropicServer` (``POST /v1/messages``) and
:class:`~sluice.testing.gemini_server.GeminiServer` (``generateContent``,
``batchEmbedContents``); their modules say what each answers.

Start them with :func:`serve_anthropic` / :func:`serve_gemini`; script faults through
``POST /_control/faults`` (:class:`~sluice.testing.faults.Fault`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict

from sluice.testing.anthropic_server import AnthropicServer
from sluice.testing.gemini_server import GeminiServer
from sluice.testing.server_process import options_from_argv, run_app, serve_app_in_process
from sluice.testing.simulated_server import (
    DEFAULT_EMBEDDING_DIMENSIONS,
    ProviderLimits,
    ServerOptions,
    SimulatedServer,
)

SERVERS: dict[str, type[SimulatedServer]] = {"anthropic": AnthropicServer, "gemini": GeminiServer}


@contextmanager
def _serve(
    kind: str,
    limits: ProviderLimits | None,
    host: str,
    api_key: str | None,
    models: Sequence[str] | None,
    embedding_dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
) -> Iterator[str]:
    options = ServerOptions(None, None if models is None else tuple(models), embedding_dimensions)
    args = [kind, json.dumps(asdict(limits or ProviderLimits())), host, options.public_json()]
    with serve_app_in_process("sluice.testing.llm_servers", args, api_key) as url:
        yield url


@contextmanager
def serve_anthropic(
    limits: ProviderLimits | None = None,
    host: str = "127.0.0.1",
    *,
    api_key: str | None = None,
    models: Sequence[str] | None = None,
) -> Iterator[str]:
    """Serve an :class:`AnthropicServer` in a process of its own; yield its base URL (the API is
    at ``{url}/v1/messages``). ``limits``: none by default; ``api_key``: the ``x-api-key`` it
    wants (None: any); ``models``: the models it knows (None: any)."""
    with _serve("anthropic", limits, host, api_key, models) as url:
        yield url


@contextmanager
def serve_gemini(
    limits: ProviderLimits | None = None,
    host: str = "127.0.0.1",
    *,
    api_key: str | None = None,
    models: Sequence[str] | None = None,
    embedding_dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
) -> Iterator[str]:
    """Serve a :class:`GeminiServer` in a process of its own; yield its base URL (the API is at
    ``{url}/v1beta/models/...``). Options as :func:`serve_anthropic`, and the embeddings'
    length unless a request sets ``outputDimensionality``."""
    with _serve("gemini", limits, host, api_key, models, embedding_dimensions) as url:
        yield url


if __name__ == "__main__":
    server = SERVERS[sys.argv[1]](ProviderLimits(**json.loads(sys.argv[2])), options_from_argv(sys.argv[4:]))
    run_app(server.app, sys.argv[3])
