"""OpenTelemetry traces of the sessions and calls (docs/operations.md#traces).

Off by default, and then nothing of OpenTelemetry is set up: no provider, no span; the
session's reply pipeline holds `trace = None` and each hook is one `is not None` check.
`tracing_from_env(endpoint)` turns it on when `--otel-endpoint` (the `otel_endpoint`
setting) or `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` names a
collector. The flag means what `OTEL_EXPORTER_OTLP_ENDPOINT` means (a base URL; the HTTP
exporter appends `/v1/traces`); the protocol is `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`
(`http/protobuf`, the default, or `grpc`); the SDK reads the other `OTEL_*` variables
itself (headers, timeouts, certificates, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`);
the service name is `OTEL_SERVICE_NAME`, else `rtmedia`. A `BatchSpanProcessor` exports from
its own thread, never on the event loop.

A server holds its own `TracerProvider` (`Tracing`), never the process-global one, so that
servers in one process (tests) keep their spans apart.

One trace per Converse session (`SessionTrace`): the root span `rtmedia.session` (the child
of a client's W3C `traceparent` metadata when it sends one), an `rtmedia.turn` per user turn
from its speech_started to its response's end (`rtmedia.response` for a response that answers
no turn: response.create on the history, a tool call's filler or apology), and under it the
stages, named after `response.timings`: `turn_detection`, `transcription`, `responder` (event
`first_text`), `first_audio`, one `tts.clause` per synthesis item, `tool_call`, `barge_in`.
The session keeps perf_counter marks of each stage (server/session/reply.py, server/hearing/recognition.py);
spans are started and ended at those moments, converted to the wall clock. The `responder`
span is live while the responder streams, so an upstream LLM server's request carries its
`traceparent` (`ReplyRequest.headers`). Other RPCs get a server span each (`RpcTracing`).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from rtmedia.engines.responders.contract import ReplyRequest

PROTOCOLS = ("http/protobuf", "grpc")
SCOPE = "rtmedia.server"
_PROPAGATOR = TraceContextTextMapPropagator()
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes and tooling: no spans


@dataclasses.dataclass(frozen=True)
class TraceExport:
    """Where spans go: `endpoint` the flag's base URL ("": the SDK reads the OTEL_* variables)."""

    endpoint: str
    protocol: str


def tracing_from_env(endpoint: str = "", environ: Mapping[str, str] | None = None) -> TraceExport | None:
    """The export the flag and the environment ask for, or None: tracing is off. A protocol
    other than http/protobuf or grpc, or an endpoint that is no http(s) URL, raises ValueError
    with one line naming it."""
    env = os.environ if environ is None else environ
    endpoint = (endpoint or "").strip()
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if not (
        endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not supported; use http/protobuf or grpc"
        )
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise ValueError(
            f"otel_endpoint (--otel-endpoint) must be an http:// or https:// URL such as "
            f"http://collector:4318, got {endpoint!r}"
        )
    return TraceExport(endpoint, protocol)


def otlp_exporter(export: TraceExport) -> Any:
    """The OTLP span exporter of `export`. The flag's URL is a base URL, as
    OTEL_EXPORTER_OTLP_ENDPOINT is: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, when set, wins over it."""
    endpoint = None
    if export.endpoint and not os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        endpoint = (
            export.endpoint if export.protocol == "grpc" else export.endpoint.rstrip("/") + "/v1/traces"
        )
    if export.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint)


def resource() -> Resource:
    """The SDK's resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME), named `rtmedia` unless
    those name the service."""
    detected = Resource.create()
    if str(detected.attributes.get("service.name", "")).startswith("unknown_service"):
        detected = detected.merge(Resource({"service.name": "rtmedia"}))
    return detected


class Tracing:
    """A server's tracer provider and what its services need of it. `processor`: where spans
    go (a BatchSpanProcessor over the OTLP exporter; a SimpleSpanProcessor in tests)."""

    def __init__(self, processor: SpanProcessor) -> None:
        self.provider = TracerProvider(resource=resource())
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(SCOPE)
        self.models: dict[str, str] = {}  # responder -> model, for the spans' rtmedia.model

    @classmethod
    def exporting(cls, export: TraceExport) -> Tracing:
        return cls(BatchSpanProcessor(otlp_exporter(export)))

    def session(
        self, session_id: str, caller: str | None, transport: str, metadata: Any, settings: Any
    ) -> SessionTrace:
        """The trace of a new Converse session; `metadata`: the call's (its traceparent continued)."""
        return SessionTrace(self, session_id, caller, transport, parent_context(metadata), settings)

    def shutdown(self) -> None:
        """Export what is pending and stop (blocking: call it off the event loop)."""
        self.provider.shutdown()


def parent_context(metadata: Any) -> otel_context.Context | None:
    """The context a call's W3C `traceparent` (and `tracestate`) metadata continues; None without one."""
    carrier = {k: v for k, v in metadata or () if k in ("traceparent", "tracestate") and isinstance(v, str)}
    return _PROPAGATOR.extract(carrier) if "traceparent" in carrier else None


def trace_headers(span: Span) -> dict[str, str]:
    """`traceparent` (and `tracestate`) naming `span`, for a request made on its behalf."""
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
    return headers


class SessionTrace:
    """The spans of one session (module docstring). The reply pipeline calls `responder_started`,
    `responder_ended`, `clause`, `response_done` and `cancelled`; the service calls `end`."""

    def __init__(
        self,
        tracing: Tracing,
        session_id: str,
        caller: str | None,
        transport: str,
        parent: otel_context.Context | None,
        settings: Any,
    ) -> None:
        self.tracing = tracing
        self.tracer = tracing.tracer
        # perf_counter -> the wall clock in ns, taken per session (the two drift apart slowly).
        self._offset_ns = time.time_ns() - time.perf_counter_ns()
        attributes = {
            "rtmedia.session.id": session_id,
            "rtmedia.transport": transport,
            **self._settings(settings),
        }
        if caller is not None:
            attributes["rtmedia.token.name"] = caller
        self.root = self.tracer.start_span(
            "rtmedia.session", context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        self._root_context = trace.set_span_in_context(self.root)
        self._open: dict[str, Span] = {}  # turn or response spans by key, until their response ends
        self._latest: Span | None = None  # the latest response's turn (or response) span
        self._responders: dict[str, Span] = {}  # live responder spans by response id
        self.turns = 0

    def ns(self, at: float) -> int:
        """A perf_counter mark as OpenTelemetry's time (ns since the epoch)."""
        return round(at * 1e9) + self._offset_ns

    def _settings(self, settings: Any) -> dict[str, Any]:
        responder = settings.responder
        out = {
            "rtmedia.responder": responder,
            "rtmedia.voice": settings.voice,
            "rtmedia.turn_detection": settings.turn_type,
        }
        if model := self.tracing.models.get(responder):
            out["rtmedia.model"] = model
        return out

    def _parent(self, response: Any) -> Span:
        """The span a response's stages go under: its turn's (from the turn's speech_started)
        or, for a response that answers no turn, its own (from its creation); made when first needed."""
        turn = response.turn
        key = f"turn:{turn.item_id}" if turn is not None else f"response:{response.response_id}"
        span = self._open.get(key)
        if span is None:
            if turn is not None:
                self.turns += 1
                span = self.tracer.start_span(
                    "rtmedia.turn",
                    context=self._root_context,
                    start_time=self.ns(turn.started_at),
                    attributes={"rtmedia.turn.item_id": turn.item_id},
                )
            else:
                span = self.tracer.start_span(
                    "rtmedia.response", context=self._root_context, start_time=self.ns(response.created_at)
                )
            self._open[key] = span
        return span

    def _stage(self, name: str, parent: Span, start: float, end: float, **attributes: Any) -> Span:
        span = self.tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            start_time=self.ns(start),
            attributes={f"rtmedia.{k}": v for k, v in attributes.items()},
        )
        span.end(end_time=self.ns(max(start, end)))
        return span

    # ---- the reply pipeline's hooks --------------------------------------------------------
    def responder_started(self, response: Any, responder: str, request: ReplyRequest) -> ReplyRequest:
        """The responder is asked for the reply: its span starts, and the request carries its
        traceparent (an upstream LLM server's request continues the trace)."""
        attributes = {
            "rtmedia.responder": responder,
            "rtmedia.response.id": response.response_id,
            "rtmedia.responder.prepared": response.held is not None,
        }
        if model := self.tracing.models.get(responder):
            attributes["rtmedia.model"] = model
        span = self.tracer.start_span(
            "responder", context=trace.set_span_in_context(self._parent(response)), attributes=attributes
        )
        self._responders[response.response_id] = span
        return dataclasses.replace(request, headers={**request.headers, **trace_headers(span)})

    def responder_ended(self, response: Any, outcome: str = "") -> None:
        """The responder's stream ended (`outcome`: why it stopped early: failed, cancelled, discarded)."""
        span = self._responders.pop(response.response_id, None)
        if span is None:
            return
        if response.first_text_at:
            span.add_event("first_text", timestamp=self.ns(response.first_text_at))
        if outcome:
            span.set_attribute("rtmedia.outcome", outcome)
            if outcome == "failed":
                span.set_status(Status(StatusCode.ERROR))
        span.end()

    def clause(self, response: Any, text: str, started: float, ended: float, audio_s: float) -> None:
        """One TTS item synthesised (a clause, or a later window of a long sentence: text "")."""
        self._stage(
            "tts.clause",
            self._parent(response),
            started,
            ended,
            **{"tts.text_chars": len(text), "tts.audio_ms": round(audio_s * 1000)},
        )

    def response_done(
        self, response: Any, status: str, reason: str, settings: Any, timings: Mapping[str, Any]
    ) -> None:
        """The response ended (response.done): its turn's stages, its tool calls, and the turn's
        span end at its end."""
        parent = self._parent(response)
        self.responder_ended(response, "" if status != "cancelled" else "cancelled")
        turn = response.turn
        if turn is not None and turn.stopped_at:
            if turn.speech_end_at:
                self._stage(
                    "turn_detection",
                    parent,
                    turn.speech_end_at,
                    turn.stopped_at,
                    **{"turn.end_reason": turn.end_reason or "commit"},
                )
            if response.transcript_at:
                self._stage("transcription", parent, turn.stopped_at, response.transcript_at)
        if response.first_audio_ready_at:
            self._stage(
                "first_audio",
                parent,
                response.first_text_at or response.created_at,
                response.first_audio_ready_at,
            )
        for call in response.calls:  # the name only: the arguments are the user's data
            self._stage(
                "tool_call",
                parent,
                call.begun_at,
                response.done_at,
                **{"tool.name": call.call.name, "tool.call_id": call.call.call_id},
            )
        attributes: dict[str, Any] = {
            **self._settings(settings),
            "rtmedia.response.id": response.response_id,
            "rtmedia.response.status": status,
            "rtmedia.preemptive": str(timings.get("preemptive", "none")),
            "rtmedia.output_audio_ms": response.sent_ms,
            **{f"rtmedia.timings.{k}": v for k, v in timings.items() if k != "preemptive"},
        }
        if reason:
            attributes["rtmedia.response.status_reason"] = reason
        if turn is not None:
            attributes["rtmedia.turn.end_reason"] = turn.end_reason or "commit"
            attributes["rtmedia.turn.audio_ms"] = turn.audio_ms
        if response.filler:
            attributes["rtmedia.response.filler"] = True
        if status == "failed":
            parent.set_status(Status(StatusCode.ERROR))
        parent.set_attributes(attributes)
        self._latest = parent
        key = f"turn:{turn.item_id}" if turn is not None else f"response:{response.response_id}"
        self._open.pop(key, None)
        parent.end(end_time=self.ns(response.done_at or time.perf_counter()))

    def cancelled(
        self,
        response: Any,
        reason: str,
        was_generating: bool,
        now: float,
        settings: Any,
        timings: Mapping[str, Any],
    ) -> None:
        """The response was cancelled (`reason`; turn_detected: a barge-in). A barge-in is a
        `barge_in` span from the reply's first audio to the cut, with what the user heard; one
        still generating ends as response.done{cancelled}."""
        heard = min(response.sent_ms, response.played_ms(now))
        if was_generating:
            parent = self._parent(response)
            parent.set_attributes(
                {"rtmedia.interrupted": reason == "turn_detected", "rtmedia.heard_ms": heard}
            )
        else:
            parent = self._latest
        if reason == "turn_detected" and parent is not None:
            self._stage(
                "barge_in",
                parent,
                response.first_audio_at or now,
                now,
                **{
                    "heard_ms": heard,
                    "output_audio_ms": response.sent_ms,
                    "response.id": response.response_id,
                },
            )
        if was_generating:
            self.response_done(response, "cancelled", reason, settings, timings)

    def discarded(self, response: Any) -> None:
        """A preemptive reply went unseen: its responder span ends, marked."""
        self.responder_ended(response, "discarded")

    def end(self, reason: str, settings: Any) -> None:
        """The session ended: turns that got no response end now, then the root."""
        for span in self._open.values():
            span.set_attribute("rtmedia.response.status", "none")
            span.end()
        for span in self._responders.values():
            span.end()
        self._open.clear()
        self._responders.clear()
        self.root.set_attributes(
            {
                **self._settings(settings),
                "rtmedia.session.close_reason": reason,
                "rtmedia.session.turns": self.turns,
            }
        )
        self.root.end()


class RpcTracing(grpc.aio.ServerInterceptor):
    """A server span per RPC other than Converse (whose session has its own trace), health and
    reflection: `rtmedia.v1.SpeechService/Synthesize` and the like, the child of the call's
    `traceparent` when it has one."""

    def __init__(
        self, tracing: Tracing, skip: Iterable[str] = ("/rtmedia.v1.RealtimeService/Converse",)
    ) -> None:
        self.tracer = tracing.tracer
        self.skip = tuple(skip)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in self.skip or method.startswith(_OPEN_METHODS):
            return handler
        kind = next(
            k
            for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
            if getattr(handler, k) is not None
        )
        parent = parent_context(handler_call_details.invocation_metadata)
        return handler._replace(**{kind: self._traced(getattr(handler, kind), method.lstrip("/"), parent)})

    def _traced(self, behavior: Any, name: str, parent: otel_context.Context | None) -> Any:
        tracer = self.tracer
        attributes = {"rpc.system": "grpc", "rpc.method": name}

        def failed(span: Span, exc: BaseException) -> None:
            if not isinstance(exc, GeneratorExit):
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))

        if inspect.isasyncgenfunction(behavior):

            async def stream(request, context):
                span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as exc:
                    failed(span, exc)
                    raise
                finally:
                    span.end()

            return stream

        async def unary(request, context):
            span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
            try:
                return await behavior(request, context)
            except BaseException as exc:
                failed(span, exc)
                raise
            finally:
                span.end()

        return unary
