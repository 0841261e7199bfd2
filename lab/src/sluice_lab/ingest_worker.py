"""The drain benchmark's worker: the service's built-in job types, stopping within 5 s.

It is ``sluice.service.handlers:worker`` with a shorter shutdown grace, so
that a benchmark run ends promptly; like it, it keeps the engine's events
stream as long as the API does (``sluice.service.config.EVENTS_MAXLEN``), so
that the transition sink, not the reconciler, is what the drain measures.
"""

from __future__ import annotations

from sluice.service.config import EVENTS_MAXLEN
from sluice.service.handlers import service_worker

#: What ``sluice serve`` trims the stream to.
SERVICE_EVENTS_MAXLEN: int = EVENTS_MAXLEN

#: ``sluice worker sluice_lab.ingest_worker:worker --queue Q`` (the benchmark passes the queue).
worker = service_worker(shutdown_grace=5.0)
