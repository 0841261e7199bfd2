"""The service's settings, read from the environment once, at start (pydantic-settings).

Only the entry points read the environment (docs/architecture.md, "Settings");
``create_app`` takes a :class:`ServiceSettings`, so tests and embedding
programs pass their own.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from sluice.settings import DEFAULT_PREFIX

#: The engine events stream's length in service mode: the transition sink must read an event
#: before the stream's trimming passes it. Workers of the service's queue trim to it as well.
EVENTS_MAXLEN = 500_000


class ServiceSettings(BaseSettings):
    """``SLUICE_*`` variables of ``sluice serve`` and ``sluice dev``.

    Authentication is not among them: no variable can turn it off. Only
    ``sluice dev`` runs without it, by passing ``auth=False`` to ``create_app``.
    """

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore", frozen=True)

    redis_url: str = Field(description="Redis (or Redis Cluster) URL")
    database_url: str = Field(description="PostgreSQL URL of the system of record")
    prefix: str = Field(DEFAULT_PREFIX, description="Redis key prefix")
    queue: str = Field("jobs", description="The engine queue that API jobs go to")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest request body accepted (413 beyond)")
    #: The engine events stream's length in service mode: the sink must read an event before
    #: the stream's trimming passes it (the reconciler catches up on what it missed).
    events_maxlen: int = Field(EVENTS_MAXLEN, ge=10_000)
    #: Run the transition sink and the reconciler in this process.
    sink: bool = True
    #: Seconds a QUEUED job may be missing from Redis before the reconciler enqueues it again.
    reconcile_grace: float = Field(30.0, gt=0)
    reconcile_interval: float = Field(10.0, gt=0)
    #: Seconds between copies of the budgets into the store (what a rebuild starts from).
    budget_copy_interval: float = Field(5.0, gt=0)
    #: Backpressure: submissions get 429 when the backlog would take longer than this to drain
    #: at the measured rate, or when more than ``max_depth`` jobs wait.
    max_backlog_seconds: float = Field(300.0, gt=0)
    max_depth: int = Field(1_000_000, ge=1)
    #: Requests per second each API key may make, shared by all API processes (0: no limit),
    #: and how many may come at once above that rate.
    rate_limit: float = Field(200.0, ge=0)
    rate_burst: int = Field(400, ge=1)
    #: Failure analysis: seconds between passes of the collector that groups the jobs that ended
    #: badly into patterns (in the process whose sink leads, beside the reconciler).
    failure_collect_interval: float = Field(30.0, gt=0)
    #: The budget every LLM failure analysis spends from (made with a daily window of
    #: ``analysis_budget_tokens`` when missing): analyses are never unbudgeted.
    analysis_budget: str = Field(
        "failure-analysis", pattern=r"^[A-Za-z0-9_.:-]{1,100}$", description="Budget of the LLM analyses"
    )
    analysis_budget_tokens: int = Field(200_000, ge=1, le=10**12)
    #: The provider's published limits for the model jobs use (requests and tokens per minute):
    #: set at start as the queue's shared gates, which every worker process obeys together.
    #: None leaves the gates as they are (``sluice flow`` sets them by hand).
    llm_rpm: int | None = Field(None, ge=1, le=10**9)
    llm_tpm: int | None = Field(None, ge=1, le=10**12)
    #: Seconds between purges of the semantic cache's expired entries (bounded batches).
    cache_purge_interval: float = Field(60.0, gt=0)
    #: The LLM provider and model (ours, or ArQueue's names): without a provider, asking for an
    #: LLM analysis is refused (409); the rule-based analysis needs none.
    llm_provider: str | None = Field(
        None, validation_alias=AliasChoices("SLUICE_LLM_PROVIDER", "AI_PROVIDER")
    )
    llm_model: str | None = Field(None, validation_alias=AliasChoices("SLUICE_LLM_MODEL", "AI_MODEL"))
