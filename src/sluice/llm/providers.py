"""The provider and model a deployment chose, from its environment.

``SLUICE_LLM_PROVIDER`` (or ArQueue's ``AI_PROVIDER``) names the provider, ``SLUICE_LLM_MODEL``
(or ``AI_MODEL``) the model; ``SLUICE_LLM_BASE_URL`` points any of them elsewhere (a proxy,
a gateway, a loopback server in tests). The keys stay where each provider's own tools look:
``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``, ``GEMINI_API_KEY`` or ``GOOGLE_API_KEY``, and
``SLUICE_LLM_API_KEY`` for an OpenAI-compatible server that wants one.

:func:`provider_for` builds another provider by name (a job that asks for one): the base URL
and model settings belong to the configured provider only, so another one gets its own
defaults, never the configured provider's server or model.
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
#: Every name a provider may be asked for by: the providers and their aliases (lowercase; the
#: functions here also take them in any case, around spaces).
KNOWN_PROVIDERS: frozenset[str] = frozenset(PROVIDERS) | frozenset(ALIASES)
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


def _canonical(name: str) -> str | None:
    """The provider of :data:`PROVIDERS` a name or alias means (any case), or None."""
    key = name.strip().lower()
    canonical = ALIASES.get(key, key)
    return canonical if canonical in PROVIDERS else None


def _configured(env: Mapping[str, str]) -> str | None:
    """The provider ``SLUICE_LLM_PROVIDER`` / ``AI_PROVIDER`` configures (``openai`` when neither is
    set, as :func:`provider_name_from_env` says), or None when they name none Sluice knows."""
    found = _setting(env, ENV_PROVIDER, ARQUEUE_ENV_PROVIDER)
    return "openai" if found is None else _canonical(found[0])


def _build(
    name: str,
    env: Mapping[str, str],
    *,
    model: str | None,
    base_url: str | None,
    timeout: float | httpx.Timeout | None,
    hint: str,
    missing_base: str,
) -> Provider:
    """Provider ``name`` (one of :data:`PROVIDERS`) at ``base_url`` (None: its own default), with
    ``model`` as its default model; ``missing_base`` is the advice when an OpenAI-compatible
    server has no URL."""
    if name == "anthropic":
        url = base_url or "https://api.anthropic.com"
        return AnthropicProvider(base_url=url, env=env, default_model=model, timeout=timeout, key_hint=hint)
    if name == "gemini":
        url = base_url or "https://generativelanguage.googleapis.com"
        return GeminiProvider(base_url=url, env=env, default_model=model, timeout=timeout, key_hint=hint)
    if name == "ollama":
        url = base_url or ollama_url(env.get(ENV_OLLAMA_HOST, "").strip())
        return OpenAIProvider(
            base_url=url, api_key_env=None, env=env, name="ollama", default_model=model, timeout=timeout
        )
    if name == "openai-compatible":
        if base_url is None:
            raise ConfigurationError(missing_base)
        return OpenAIProvider(
            base_url=base_url,
            api_key_env=ENV_API_KEY,
            env=env,
            name="openai-compatible",
            default_model=model,
            timeout=timeout,
        )
    url = base_url or "https://api.openai.com/v1"
    return OpenAIProvider(base_url=url, env=env, default_model=model, timeout=timeout, key_hint=hint)


def provider_from_env(
    env: Mapping[str, str] | None = None, *, timeout: float | httpx.Timeout | None = None
) -> Provider:
    """The provider the environment chooses, built (so a missing key fails now, naming the
    variable to set), with its ``default_model`` attribute from :func:`model_from_env` (None for
    an OpenAI-compatible server without ``SLUICE_LLM_MODEL``)."""
    env = environment() if env is None else env
    name = provider_name_from_env(env)
    found = _setting(env, ENV_MODEL, ARQUEUE_ENV_MODEL)
    base = _setting(env, ENV_BASE_URL)
    return _build(
        name,
        env,
        model=found[0] if found is not None else DEFAULT_MODELS[name],
        base_url=base[0] if base is not None else None,
        timeout=timeout,
        hint=f" (or choose another provider with {ENV_PROVIDER}: {', '.join(PROVIDERS)})",
        missing_base=(
            f"{ENV_PROVIDER}=openai-compatible needs {ENV_BASE_URL}: set it to the server's API root "
            "(e.g. http://localhost:8000/v1 for vLLM, http://localhost:1234/v1 for LM Studio)"
        ),
    )


def provider_for(
    name: str, env: Mapping[str, str] | None = None, *, timeout: float | httpx.Timeout | None = None
) -> Provider:
    """Provider ``name`` (one of :data:`KNOWN_PROVIDERS`, any case), built from ``env`` (None: the
    process's environment) with its own key variable.

    ``SLUICE_LLM_BASE_URL`` and ``SLUICE_LLM_MODEL`` (``AI_MODEL``) configure the provider that
    ``SLUICE_LLM_PROVIDER`` (``AI_PROVIDER``) chooses, and apply only when ``name`` is that one
    (then this is :func:`provider_from_env`): a job naming another provider must reach that
    provider's own API with its default model, not send its key to the configured provider's
    proxy or ask it for the configured model. So an ``openai-compatible`` server, which has no
    default URL, can only be the configured provider. ConfigurationError for an unknown name,
    or a missing key (naming the variable to set).
    """
    env = environment() if env is None else env
    canonical = _canonical(name)
    if canonical is None:
        raise ConfigurationError(
            f"{name!r} is not a provider Sluice knows: use one of {', '.join(sorted(KNOWN_PROVIDERS))}"
        )
    if canonical == _configured(env):
        return provider_from_env(env, timeout=timeout)
    return _build(
        canonical,
        env,
        model=DEFAULT_MODELS[canonical],
        base_url=None,
        timeout=timeout,
        hint="",
        missing_base=(
            f"an openai-compatible server has no default URL, and {ENV_BASE_URL} is the configured "
            f"provider's: set {ENV_PROVIDER}=openai-compatible and {ENV_BASE_URL} to use one"
        ),
    )
