"""What a ``sluice bench ingest`` run is asked to do, and the targets it is judged by."""

from __future__ import annotations

from dataclasses import dataclass

#: The targets of issue 10 (2-core machine).
TARGET_RATE = 1500.0
TARGET_P95_MS = 10.0
TARGET_DRAIN_RATIO = 0.60
#: Worker target of the drain (see :mod:`sluice_lab.ingest_worker` for why not the service's own).
DRAIN_WORKER = "sluice_lab.ingest_worker:worker"
#: Routes the generator can load, and the body each takes (``{i}``: the request's number).
ROUTES = {
    "/jobs": ('{{"type":"generic","payload":{{"n":{{i}}}},"idempotencyKey":"{key}{{i}}"}}', 201),
    "/v1/jobs": ('{{"type":"generic","payload":{{"n":{{i}}}},"idempotency_key":"{key}{{i}}"}}', 201),
    "/enqueue": ('{{"type":"generic","payload":{{"n":{{i}}}},"idempotencyKey":"{key}{{i}}"}}', 201),
}
#: A rate is saturated (and the higher ones are not run) below this share of it, or above this
#: share of errors.
SATURATED_SHARE = 0.9
SATURATED_ERRORS = 0.01

DEFAULT_RATES = (100.0, 200.0, 500.0, 1000.0, 1500.0, 2000.0)
DEFAULT_API_PROCESSES = (1, 2)
DEFAULT_RACES = (500, 1000, 2000)

#: Submissions/s of the warm-up: well under what one API process takes, so it warms without a backlog.
WARMUP_RATE = 50.0


@dataclass(frozen=True, slots=True)
class IngestSpec:
    """One ``sluice bench ingest`` run."""

    rates: tuple[float, ...] = DEFAULT_RATES
    seconds: float = 60.0
    #: API process counts measured, one ``sluice serve -p N`` each
    api_processes: tuple[int, ...] = DEFAULT_API_PROCESSES
    route: str = "/jobs"
    #: generator processes sharing each rate
    generators: int = 1
    #: "raw" (the generator's own HTTP/1.1 client) or "httpx"
    client: str = "raw"
    #: connections a generator may open (a request waits for one when all are busy)
    max_connections: int = 512
    #: a request not answered this long after it was due is an error
    timeout: float = 10.0
    #: seconds at a low rate before the measured rates (connections, pools, caches)
    warmup_seconds: float = 3.0
    #: past the first saturated rate, run only the target rate (the others would say nothing new)
    stop_when_saturated: bool = True
    races: tuple[int, ...] = DEFAULT_RACES
    #: 0: no drain comparison
    drain_jobs: int = 20_000
    drain_workers: int = 2
    drain_concurrency: int = 50
    #: API processes while the store is kept up to date (None: the largest of api_processes)
    drain_api_processes: int | None = None
    drain_worker: str = DRAIN_WORKER
    drain_timeout: float = 300.0
    #: pairs of drains (with the store, then the engine alone); the ratio is their median
    drain_rounds: int = 3

    def __post_init__(self) -> None:
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        if self.client not in ("raw", "httpx"):
            raise ValueError(f"client must be raw or httpx, got {self.client!r}")
        if not self.api_processes or min(self.api_processes) < 1:
            raise ValueError("api_processes needs at least one count of 1 or more")
        if any(r <= 0 for r in self.rates) or self.seconds <= 0:
            raise ValueError("rates and seconds must be more than 0")
        if self.generators < 1 or self.max_connections < 1:
            raise ValueError("generators and max_connections must be at least 1")
        if self.drain_rounds < 1:
            raise ValueError(f"drain_rounds must be at least 1, got {self.drain_rounds}")

    @property
    def drain_processes(self) -> int:
        return self.drain_api_processes or max(self.api_processes)
