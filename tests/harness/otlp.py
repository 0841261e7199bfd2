"""A loopback OTLP/HTTP receiver for the tracing tests: a real HTTP server that takes what
OpenTelemetry's exporter posts to ``/v1/traces`` (protobuf, as a collector would) and keeps
the spans, decoded with opentelemetry-proto (which the exporter brings)."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

#: OTLP's span kinds (opentelemetry.proto.trace.v1.Span.SpanKind).
KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    kind: str
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    service: str
    events: list[tuple[str, dict[str, Any]]]


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in pairs}


class Collector:
    """Spans received so far (thread-safe); ``url`` is the OTLP endpoint's base."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                collector._take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _take(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append(
                        Span(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=KINDS.get(s.kind, str(s.kind)),
                            attributes=_attributes(s.attributes),
                            status=s.status.code,
                            service=str(resource.get("service.name", "")),
                            events=[(e.name, _attributes(e.attributes)) for e in s.events],
                        )
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(found)

    def named(self, name: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def wait_for(self, done: Callable[[list[Span]], bool], timeout: float = 20.0) -> list[Span]:
        """The spans once ``done(spans)`` holds; AssertionError with what came after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans received: {[(s.name, s.attributes) for s in spans]}")
            time.sleep(0.05)


@contextmanager
def otlp_collector() -> Iterator[Collector]:
    collector = Collector()
    thread = threading.Thread(target=collector.server.serve_forever, name="otlp-collector", daemon=True)
    thread.start()
    try:
        yield collector
    finally:
        collector.server.shutdown()
        collector.server.server_close()
        thread.join()
