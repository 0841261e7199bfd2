"""The drain benchmark's worker: the service's built-in job types, with the service's stream length.

``sluice worker sluice.service.handlers:worker`` trims the engine's events
stream to the engine's default (10,000 entries) on every transition it
writes, while the API processes' transition sink may be further behind than
that during a fast drain (two events per job). Entries trimmed before the
sink read them are lost to it, and those jobs reach the store only when the
reconciler finds them (after its grace, 30 s), which would measure the
reconciler, not the sink. This worker keeps the stream as long as the API
does (``ServiceSettings.events_maxlen``); benchmarks/README.md says why.
"""

from __future__ import annotations

from sluice.service.config import ServiceSettings
from sluice.service.handlers import service_worker

#: What ``sluice serve`` trims the stream to (its setting's default).
SERVICE_EVENTS_MAXLEN: int = ServiceSettings.model_fields["events_maxlen"].default

#: ``sluice worker sluice.lab.ingest_worker:worker --queue Q`` (the benchmark passes the queue).
worker = service_worker(events_maxlen=SERVICE_EVENTS_MAXLEN, shutdown_grace=5.0)
