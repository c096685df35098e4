"""Prometheus metrics (SPEC §6): names, base units, one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Buckets around the realtime frame budget (5-100 ms), with a tail for slow steps.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.032, 0.05, 0.08, 0.1, 0.2, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
RPC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """All of rtmedia's metrics, registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.lane_queue_depth = Gauge(
            "rtmedia_lane_queue_depth", "Work items waiting in a lane", ["lane"], registry=r
        )
        self.lane_batch_size = Histogram(
            "rtmedia_lane_batch_size", "Items per engine step", ["lane"], buckets=BATCH_BUCKETS, registry=r
        )
        self.lane_step_seconds = Histogram(
            "rtmedia_lane_step_seconds", "Engine step latency", ["lane"], buckets=STEP_BUCKETS, registry=r
        )
        self.lane_step_failures = Counter(
            "rtmedia_lane_step_failures_total", "Engine steps that raised", ["lane"], registry=r
        )
        self.bytes_total = Counter(
            "rtmedia_bytes_total", "Media payload bytes", ["direction"], registry=r
        )
        self.tts_first_audio_seconds = Histogram(
            "rtmedia_tts_first_audio_seconds", "Synthesize: request to first audio chunk",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.grpc_handled = Counter(
            "grpc_server_handled_total", "RPCs completed on the server",
            ["grpc_type", "grpc_service", "grpc_method", "grpc_code"], registry=r,
        )
        self.grpc_handling_seconds = Histogram(
            "grpc_server_handling_seconds", "RPC duration on the server",
            ["grpc_type", "grpc_service", "grpc_method"], buckets=RPC_BUCKETS, registry=r,
        )
