"""The provider and model a deployment chose, from its environment.

``SLUICE_LLM_PROVIDER`` (or ArQueue's ``AI_PROVIDER``) names the provider, ``SLUICE_LLM_MODEL``
(or ``AI_MODEL``) the model; ``SLUICE_LLM_BASE_URL`` points any of them elsewhere (a proxy,
a gateway, a loopback server in tests). The keys stay where each provider's own tools look:
``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``, ``GEMINI_API_KEY`` or ``GOOGLE_API_KEY``, and
``SLUICE_LLM_API_KEY`` for an OpenAI-compatible server that wants one.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from sluice.errors import ConfigurationError
from sluice.llm.anthropic import AnthropicProvider
from sluice.llm.gemini import GeminiProvider
from sluice.llm.openai import OpenAIProvider
from sluice.llm.provider import Provider
from sluice.settings import environment

ENV_PROVIDER = "SLUICE_LLM_PROVIDER"
ENV_MODEL = "SLUICE_LLM_MODEL"
ENV_BASE_URL = "SLUICE_LLM_BASE_URL"
#: The key of an OpenAI-compatible server (other providers keep their own variables).
ENV_API_KEY = "SLUICE_LLM_API_KEY"
#: ArQueue's names, read when Sluice's are not set.
ARQUEUE_ENV_PROVIDER = "AI_PROVIDER"
ARQUEUE_ENV_MODEL = "AI_MODEL"
ENV_OLLAMA_HOST = "OLLAMA_HOST"
OLLAMA_DEFAULT_URL = "http://localhost:11434/v1"

PROVIDERS = ("openai", "anthropic", "gemini", "ollama", "openai-compatible")
ALIASES = {
    "claude": "anthropic",
    "google": "gemini",
    "openai_compatible": "openai-compatible",
    "compatible": "openai-compatible",
}
#: The model used when none is set: each provider's small, cheap current model (an
#: OpenAI-compatible server has none: its models are whatever it serves).
DEFAULT_MODELS: dict[str, str | None] = {
    "openai": "gpt-4o-mini",
    "anthropic": "claude-haiku-4-5",
    "gemini": "gemini-2.5-flash",
    "ollama": "llama3.2",
    "openai-compatible": None,
}


def _setting(env: Mapping[str, str] | None, *names: str) -> tuple[str, str] | None:
    """(value, variable) of the first of ``names`` set to something in ``env`` (None: the
    process's environment)."""
    env = environment() if env is None else env
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value, name
    return None


def provider_name_from_env(env: Mapping[str, str] | None = None) -> str:
    """The provider chosen (``openai`` when nothing is set), as one of :data:`PROVIDERS`."""
    found = _setting(env, ENV_PROVIDER, ARQUEUE_ENV_PROVIDER)
    if found is None:
        return "openai"
    value, variable = found
    name = ALIASES.get(value.lower(), value.lower())
    if name not in PROVIDERS:
        raise ConfigurationError(
            f"{variable}={value!r} is not a provider Sluice knows: set it to one of {', '.join(PROVIDERS)} "
            f"(openai-compatible with {ENV_BASE_URL} for any other server speaking OpenAI's protocol)"
        )
    return name


def model_from_env(env: Mapping[str, str] | None = None) -> str:
    """The model chosen: ``SLUICE_LLM_MODEL``, else ``AI_MODEL``, else the provider's default."""
    found = _setting(env, ENV_MODEL, ARQUEUE_ENV_MODEL)
    if found is not None:
        return found[0]
    provider = provider_name_from_env(env)
    model = DEFAULT_MODELS[provider]
    if model is None:
        raise ConfigurationError(
            f"{ENV_MODEL} is not set, and an {provider} server has no default model: set it to a "
            "model the server serves"
        )
    return model


def ollama_url(host: str | None) -> str:
    """The OpenAI-compatible root of an Ollama server from ``OLLAMA_HOST`` (``host``,
    ``host:port`` or a URL; port 11434 unless said)."""
    if not host:
        return OLLAMA_DEFAULT_URL
    url = host if "://" in host else f"http://{host}"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ConfigurationError(
            f"{ENV_OLLAMA_HOST}={host!r} is not a host or URL ({exc}): set it like localhost:11434"
        ) from None
    if parsed.port is None and "://" not in host:
        parsed = parsed.copy_with(port=11434)
    base = str(parsed).rstrip("/")
    return base if base.endswith("/v1") else f"{base}/v1"


def provider_from_env(
    env: Mapping[str, str] | None = None, *, timeout: float | httpx.Timeout | None = None
) -> Provider:
    """The provider the environment chooses, built (so a missing key fails now, naming the
    variable to set), with its ``default_model`` attribute from :func:`model_from_env` (None for
    an OpenAI-compatible server without ``SLUICE_LLM_MODEL``)."""
    env = environment() if env is None else env
    name = provider_name_from_env(env)
    found = _setting(env, ENV_MODEL, ARQUEUE_ENV_MODEL)
    model = found[0] if found is not None else DEFAULT_MODELS[name]
    base = _setting(env, ENV_BASE_URL)
    hint = f" (or choose another provider with {ENV_PROVIDER}: {', '.join(PROVIDERS)})"
    if name == "anthropic":
        url = base[0] if base else "https://api.anthropic.com"
        return AnthropicProvider(base_url=url, env=env, default_model=model, timeout=timeout, key_hint=hint)
    if name == "gemini":
        url = base[0] if base else "https://generativelanguage.googleapis.com"
        return GeminiProvider(base_url=url, env=env, default_model=model, timeout=timeout, key_hint=hint)
    if name == "ollama":
        url = base[0] if base else ollama_url(env.get(ENV_OLLAMA_HOST, "").strip())
        return OpenAIProvider(
            base_url=url, api_key_env=None, env=env, name="ollama", default_model=model, timeout=timeout
        )
    if name == "openai-compatible":
        if base is None:
            raise ConfigurationError(
                f"{ENV_PROVIDER}=openai-compatible needs {ENV_BASE_URL}: set it to the server's API root "
                "(e.g. http://localhost:8000/v1 for vLLM, http://localhost:1234/v1 for LM Studio)"
            )
        return OpenAIProvider(
            base_url=base[0],
            api_key_env=ENV_API_KEY,
            env=env,
            name="openai-compatible",
            default_model=model,
            timeout=timeout,
        )
    url = base[0] if base else "https://api.openai.com/v1"
    return OpenAIProvider(base_url=url, env=env, default_model=model, timeout=timeout, key_hint=hint)
