"""server/observe/tracing.py's settings: when tracing is on (the flag, the OTEL_* endpoint variables),
which protocol and URL the exporter gets, the one-line errors, the service name; and that a
server without tracing sets nothing of OpenTelemetry up (no provider, global or its own)."""

from __future__ import annotations

import argparse

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from rtmedia.server.cli import build_parser, config_from_args
from rtmedia.server.observe.tracing import TraceExport, otlp_exporter, resource, tracing_from_env

OTEL = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in OTEL:
        monkeypatch.delenv(name, raising=False)


def test_off_without_an_endpoint():
    assert tracing_from_env("", {}) is None
    # a protocol alone turns nothing on
    assert tracing_from_env("", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) is None


@pytest.mark.parametrize(
    "endpoint, environ, expected",
    [
        ("http://collector:4318", {}, TraceExport("http://collector:4318", "http/protobuf")),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, TraceExport("", "http/protobuf")),
        (
            "",
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"},
            TraceExport("", "http/protobuf"),
        ),
        ("http://c:4317", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, TraceExport("http://c:4317", "grpc")),
        (
            "http://c:4317",
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
            TraceExport("http://c:4317", "grpc"),
        ),
    ],
)
def test_on_when_the_flag_or_a_variable_names_an_endpoint(endpoint, environ, expected):
    assert tracing_from_env(endpoint, environ) == expected


def test_otel_sdk_disabled_turns_it_off():
    assert tracing_from_env("http://c:4318", {"OTEL_SDK_DISABLED": "true"}) is None


@pytest.mark.parametrize(
    "endpoint, environ, says",
    [
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "'http/json' is not supported"),
        (
            "",
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"},
            "'udp' is not supported",
        ),
        ("collector:4318", {}, "must be an http:// or https:// URL"),
    ],
)
def test_a_bad_value_is_one_line(endpoint, environ, says):
    with pytest.raises(ValueError) as refused:
        tracing_from_env(endpoint, environ)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_serve_flag_and_its_check_before_anything_starts(monkeypatch):
    args = build_parser().parse_args(["serve", "--otel-endpoint", "http://collector:4318"])
    assert (
        isinstance(args, argparse.Namespace)
        and config_from_args(args).tracing.endpoint == "http://collector:4318"
    )
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="'thrift' is not supported"):
        config_from_args(args)


def test_the_http_exporter_appends_v1_traces_to_the_base_url():
    exporter = otlp_exporter(TraceExport("http://collector:4318/", "http/protobuf"))
    assert isinstance(exporter, HttpExporter) and exporter._endpoint == "http://collector:4318/v1/traces"
    exporter.shutdown()


def test_the_traces_variable_wins_over_the_flag(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://elsewhere:4318/custom")
    exporter = otlp_exporter(TraceExport("http://collector:4318", "http/protobuf"))
    assert exporter._endpoint == "http://elsewhere:4318/custom"
    exporter.shutdown()


def test_the_grpc_exporter_takes_the_url_as_it_is():
    exporter = otlp_exporter(TraceExport("http://collector:4317", "grpc"))
    assert isinstance(exporter, GrpcExporter)
    exporter.shutdown()


def test_the_service_is_rtmedia_unless_the_environment_names_it(monkeypatch):
    assert resource().attributes["service.name"] == "rtmedia"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    assert resource().attributes["deployment.environment"] == "staging"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "voice-eu")
    assert resource().attributes["service.name"] == "voice-eu"


def test_a_server_without_tracing_sets_nothing_up():
    from rtmedia.server.app import RtmediaServer
    from rtmedia.server.config import ServerConfig

    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, llm=False, default_responder="echo"))
    assert server.tracing is None and server.realtime.tracing is None
    # the global provider: never installed
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
