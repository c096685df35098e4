"""The rtmedia server process: gRPC services, health, reflection, metrics, drain."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server
from riva.client.proto import riva_asr_pb2, riva_asr_pb2_grpc, riva_tts_pb2, riva_tts_pb2_grpc
from rtmedia.engines.asr import AsrEngine
from rtmedia.engines.openai_chat import OpenAIResponder
from rtmedia.engines.tts import TtsEngine, default_voices, voice_from_path
from rtmedia.engines.vad import VadEngine
from rtmedia.server.audio_input import WINDOW_MS, VadTick
from rtmedia.server.config import ServerConfig
from rtmedia.server.engine_access import ASR, ASR_FINAL, TTS, VAD, VIDEO, EngineAccess
from rtmedia.server.interceptors import ServerInterceptor
from rtmedia.server.metrics import Metrics
from rtmedia.server.placement import build_lm_engines, build_video_engine, placement
from rtmedia.server.realtime_service import RealtimeService
from rtmedia.server.responders import build_responders
from rtmedia.server.riva_asr import RivaAsrService
from rtmedia.server.riva_tts import RivaTtsService
from rtmedia.server.scheduler import LanePolicy, Priority, Scheduler
from rtmedia.server.session import Limits
from rtmedia.server.session_config import SessionSettings
from rtmedia.server.speech_service import SpeechService
from rtmedia.server.video_service import VideoService
from rtmedia.v1 import realtime_pb2, realtime_pb2_grpc, speech_pb2, speech_pb2_grpc, video_pb2, video_pb2_grpc

log = logging.getLogger("rtmedia.server")

SERVICE_NAMES = [
    speech_pb2.DESCRIPTOR.services_by_name["SpeechService"].full_name,
    realtime_pb2.DESCRIPTOR.services_by_name["RealtimeService"].full_name,
    video_pb2.DESCRIPTOR.services_by_name["VideoService"].full_name,
]
RIVA_SERVICE_NAMES = [
    riva_asr_pb2.DESCRIPTOR.services_by_name["RivaSpeechRecognition"].full_name,
    riva_tts_pb2.DESCRIPTOR.services_by_name["RivaSpeechSynthesis"].full_name,
]


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Message limits (docs/protocol.md#wire-format), the read-ahead window, and keepalive chosen for
    long-lived media streams."""
    return [
        ("grpc.max_receive_message_length", config.max_receive_bytes),
        ("grpc.max_send_message_length", config.max_send_bytes),
        # Ping idle connections every 30 s so dead peers (NAT, mobile) are noticed
        # within ~40 s; let clients ping as often as every 10 s, even without calls.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 0),
        *([("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", config.stream_window_bytes)]
          if config.stream_window_bytes else []),
    ]


class RtmediaServer:
    """Builds the engines and services; `start()` binds, loads, warms, then says SERVING."""

    def __init__(self, config: ServerConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.placement = placement(config)  # device, precision, CUDA graphs (server/placement.py)
        self.scheduler = scheduler = Scheduler(self.metrics)
        voices = default_voices() + [voice_from_path(p) for p in config.voices]
        # One clause per step (Piper synthesises one text at a time, and a batch would hold every
        # result until its last one is done), two steps at once on the two cores.
        scheduler.add(TTS, TtsEngine(voices, intra_op_threads=config.tts_threads, precision=config.tts_precision),
                      LanePolicy(max_batch=1, concurrency=config.tts_concurrency))
        # One runner per PocketSphinx worker, each stepping only its own streams' items; an item
        # that only ends an utterance goes through the `asr_final` lane, which each worker
        # answers mid-step (its urgent pipe).
        asr = AsrEngine(workers=config.asr_workers, decoders=config.asr_decoders)
        for name, step in ((ASR, None), (ASR_FINAL, functools.partial(asr.step, urgent=True))):
            scheduler.add(name, asr, LanePolicy(Priority.REALTIME, max_batch=64, concurrency=config.asr_workers,
                                                shard=lambda item: item.stream.worker), step)
        # Video decode: one latent step per work item, BULK, so speech runs between any two steps.
        scheduler.add(VIDEO, build_video_engine(config, self.placement, self.metrics),
                      LanePolicy(Priority.BULK, max_batch=1, concurrency=1))
        # The VAD tick: every window, one batched step over every session's new audio.
        vad = VadEngine(parallel_runs=config.vad_threads)
        vad_tick = VadTick(vad)
        scheduler.add_tick(VAD, vad, WINDOW_MS, vad_tick.collect, vad_tick.process, vad_tick.deliver)
        lanes = {name: scheduler.add_lm(name, engine)
                 for name, engine in build_lm_engines(config, self.placement, self.metrics).items()}
        extra = {}
        if config.openai_url:
            extra["openai"] = OpenAIResponder(config.openai_url, config.openai_model, os.environ.get("OPENAI_API_KEY"))
        responders = build_responders(lanes, extra)
        if config.default_responder not in responders:
            raise ValueError(f"default_responder {config.default_responder!r} is not available; "
                             f"available: {', '.join(sorted(responders))}")
        for name in responders.keys() - lanes.keys():  # replies that are not an LM lane's: one stream lane each
            scheduler.add_stream(f"reply-{name}", LanePolicy(Priority.INTERACTIVE, concurrency=config.max_sessions))
        self.access = EngineAccess.of(scheduler, vad, vad_tick, responders)
        self.realtime = RealtimeService(self.access, max_sessions=config.max_sessions,
                                        lm_slots=config.lm_slots,
                                        defaults=SessionSettings(responder=config.default_responder),
                                        limits=Limits(
                                            early_finals=config.early_finals,
                                            max_outbox_events=config.session_outbox_events,
                                            max_outbox_bytes=config.session_outbox_bytes,
                                            max_text_chars=config.session_text_chars,
                                            max_instructions_chars=config.session_instructions_chars,
                                            max_id_bytes=config.session_id_bytes))
        self.services = SERVICE_NAMES + (RIVA_SERVICE_NAMES if config.riva else [])
        self.health = health.aio.HealthServicer()
        self.state = "starting"
        self.port = 0
        self._server: grpc.aio.Server | None = None

    def refusal(self) -> tuple[str, str] | None:
        if self.state == "serving":
            return None
        if self.state == "starting":
            return "WARMING_UP", "the server is loading its engines; retry shortly"
        return "DRAINING", "the server is shutting down; connect to another replica"

    async def _set_health(self, status: int) -> None:
        for name in ["", *self.services]:
            await self.health.set(name, status)

    async def start(self) -> int:
        server = grpc.aio.server(
            options=grpc_options(self.config),
            interceptors=[ServerInterceptor(self.metrics, self.refusal)],
        )
        speech_pb2_grpc.add_SpeechServiceServicer_to_server(
            SpeechService(self.access, self.config.max_text_chars), server
        )
        realtime_pb2_grpc.add_RealtimeServiceServicer_to_server(self.realtime, server)
        video_pb2_grpc.add_VideoServiceServicer_to_server(
            VideoService.from_config(self.access, self.config), server
        )
        if self.config.riva:  # NVIDIA Riva's speech API on the same engines
            riva_asr_pb2_grpc.add_RivaSpeechRecognitionServicer_to_server(
                RivaAsrService(self.access), server)
            riva_tts_pb2_grpc.add_RivaSpeechSynthesisServicer_to_server(
                RivaTtsService(self.access, self.config.max_text_chars), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [*self.services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        await server.start()
        self._server = server
        log.info("listening", extra={"host": self.config.host, "port": self.port})
        where = self.placement.describe()
        log.info("engines on %s: LM %s, CUDA graphs %s", where["device"], where["lm_dtype"],
                 "on" if where["cuda_graphs"] else "off", extra=where)
        await self.scheduler.load()
        self.scheduler.start()
        self.realtime.start()
        self.state = "serving"
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"port": self.port, "services": self.services})
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new calls, let active ones finish within the grace period."""
        if self.state == "stopped":
            return
        self.state = "draining"
        grace = self.config.grace_s if grace is None else grace
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        started = time.monotonic()
        await self.realtime.drain(grace)
        if self._server is not None:  # other calls get what is left of the grace period
            await self._server.stop(max(1.0, grace - (time.monotonic() - started)))
        await self.realtime.close()
        await self.scheduler.close()
        self.state = "stopped"
        log.info("stopped")


async def serve(config: ServerConfig, beside: Callable[[ServerConfig, int], Awaitable[Any]] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain gracefully. `beside(config, port)` starts what runs next
    to the server once it serves (the web front; the entry module passes it) and returns an object
    with `async stop()`."""
    server = RtmediaServer(config)
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.host, registry=server.metrics.registry)
        log.info("metrics", extra={"port": config.metrics_port})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bridge = None
    starting = asyncio.create_task(server.start(), name="server-start")
    stopping = asyncio.create_task(stop.wait(), name="stop-signal")
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a failed start raises here
            if beside is not None:
                bridge = await beside(config, server.port)
            await stopping
        log.info("signal received: draining", extra={"grace_s": config.grace_s})
    finally:
        for task in (starting, stopping):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if bridge is not None:
            await bridge.stop()
        await server.stop()
