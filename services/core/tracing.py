"""OpenTelemetry traces across the services, carried in NATS message headers.

- `setup(service)` installs a TracerProvider once per process. The exporter comes from
  the standard `OTEL_TRACES_EXPORTER`: `otlp` (OTLP over HTTP, configured by the
  standard `OTEL_EXPORTER_OTLP_*` variables), `console` (one JSON object per span and
  line on stdout), or `none` (the default). The service name is
  `OTEL_SERVICE_NAME`, else `opentinker-<service>`.
  Spans are made, and contexts propagated, even with `none`: every message keeps a
  valid W3C `traceparent`.
- `Bus.headers` injects the current span's context into each message (`inject`). A
  consumer continues the trace with `span(name, parent=extract(msg.headers))`.
- The trace of one rollout request:
  learner.request -> rollout.group -> rollout.episode -> rollout.env_step ->
  envhost EnvStepRequest ...; rollout.episode -> rollout.publish_trajectory ->
  learner.trajectory. So one episode's spans from rollout, envhost and learner share a
  trace id. Batched work (one generate call for many episodes) is a span of its own,
  with links to the episodes it served.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanKind

__all__ = ["SpanKind", "extract", "inject", "link", "setup", "shutdown", "span", "start", "within", "child_of"]

_configured = False
Context = otel_context.Context


def setup(service: str) -> None:
    """Install the process's TracerProvider (idempotent). Raises ValueError for an
    OTEL_TRACES_EXPORTER other than otlp, console or none."""
    global _configured
    if _configured:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    os.environ.setdefault("OTEL_SERVICE_NAME", f"opentinker-{service}")
    provider = TracerProvider(resource=Resource.create())
    for name in filter(None, (x.strip() for x in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(","))):
        if name == "console":
            exporter = ConsoleSpanExporter(out=sys.stdout, formatter=lambda s: s.to_json(indent=None) + "\n")
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name != "none":
            raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: use otlp, console or none")
    trace.set_tracer_provider(provider)
    _configured = True


def shutdown() -> None:
    """Flush and stop the exporters (at service exit)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("opentinker")


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context a message carries (its `traceparent`), or an empty one."""
    return propagate.extract(dict(headers or {}))


def inject(headers: dict[str, str]) -> None:
    """Write the current span's context into `headers` (W3C traceparent)."""
    propagate.inject(headers)


@contextlib.contextmanager
def span(name: str, parent: Context | None = None, attrs: Mapping[str, Any] | None = None,
         kind: SpanKind = SpanKind.INTERNAL, links: list[Link] | None = None) -> Iterator[Span]:
    """A span made current for the block; `parent` (from `extract`) continues another
    process's trace, else the current span is the parent."""
    with tracer().start_as_current_span(name, context=parent, kind=kind, attributes=dict(attrs or {}),
                                        links=links) as s:
        yield s


def start(name: str, parent: Context | None = None, attrs: Mapping[str, Any] | None = None) -> Span:
    """A span that outlives a block (an episode across turns); `end()` it."""
    return tracer().start_span(name, context=parent, attributes=dict(attrs or {}))


@contextlib.contextmanager
def within(s: Span | None) -> Iterator[None]:
    """Make `s` the current span for the block (None: leave the context as it is)."""
    if s is None:
        yield
        return
    with trace.use_span(s, end_on_exit=False):
        yield


def link(s: Span) -> Link:
    return Link(s.get_span_context())


def child_of(s: Span) -> Context:
    """A context whose current span is `s` (to start children of a span not current)."""
    return trace.set_span_in_context(s)
