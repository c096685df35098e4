"""The rtmedia server process: gRPC services, health, reflection, metrics, drain.

Health says SERVING only while the server serves (not while it starts or drains) and, for the
server ("") and each service, only while every lane it needs is healthy (the scheduler's health
watch, server/lanes/scheduler.py): a lane that cannot recover takes the services that use it out of
a load balancer's rotation until it recovers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from riva.client.proto import riva_asr_pb2, riva_asr_pb2_grpc, riva_tts_pb2, riva_tts_pb2_grpc
from rtmedia.engines.asr.pocketsphinx import AsrEngine
from rtmedia.engines.audio.denoise import Denoiser
from rtmedia.engines.responders.openai_chat import OpenAIResponder
from rtmedia.engines.tts.piper import TtsEngine, default_voices, voice_from_path
from rtmedia.engines.turn.scorers import AcousticTurnModel
from rtmedia.engines.vad.silero import VadEngine
from rtmedia.protocol.tokens import TokenTable
from rtmedia.server.config import MiB, ServerConfig
from rtmedia.server.hearing.audio_input import WINDOW_MS, VadTick
from rtmedia.server.lanes.access import ASR, ASR_FINAL, TTS, TURN_AUDIO, VAD, VIDEO, EngineAccess
from rtmedia.server.lanes.placement import (
    build_lm_engines,
    build_video_engine,
    build_whisper_engine,
    placement,
)
from rtmedia.server.lanes.responders import build_responders
from rtmedia.server.lanes.scheduler import LanePolicy, Priority, Scheduler
from rtmedia.server.observe.metrics import Metrics
from rtmedia.server.observe.metrics_http import start_metrics_http
from rtmedia.server.observe.recording import RecordingPolicy, Recordings
from rtmedia.server.observe.tracing import RpcTracing, Tracing, tracing_from_env
from rtmedia.server.security.auth import AuthInterceptor
from rtmedia.server.security.interceptors import ServerInterceptor
from rtmedia.server.security.tls import ServerTls
from rtmedia.server.services.realtime import RealtimeService
from rtmedia.server.services.riva_asr import RivaAsrService
from rtmedia.server.services.riva_tts import RivaTtsService
from rtmedia.server.services.speech import SpeechService
from rtmedia.server.services.video import VideoService
from rtmedia.server.session.config import SessionSettings
from rtmedia.server.session.session import Limits
from rtmedia.v1 import realtime_pb2, realtime_pb2_grpc, speech_pb2, speech_pb2_grpc, video_pb2, video_pb2_grpc

LIVE_WITHIN_S = 10.0  # /livez: the loop beat within this long

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

    def __init__(self, config: ServerConfig, metrics: Metrics | None = None, tracing: Tracing | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        # Traces (server/observe/tracing.py): this server's own provider, or None (off: nothing is set up).
        # Read first, so a bad OTEL_* protocol or endpoint stops the start at once with one line.
        export = tracing_from_env(config.otel_endpoint)
        self.tracing = tracing if tracing is not None else Tracing.exporting(export) if export else None
        # Read first, so a bad file stops the start at once with one line naming it.
        self.tls = ServerTls(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls_cert else None
        self.tokens = TokenTable.load(config.auth_tokens)
        self.auth = AuthInterceptor(self.tokens, lambda reason: self.metrics.auth_refused.labels(reason).inc())
        self.placement = placement(config)  # device, precision, CUDA graphs (server/lanes/placement.py)
        self.scheduler = scheduler = Scheduler(self.metrics, unhealthy_after_s=config.lane_unhealthy_after_s)
        deadline = config.step_deadline
        voices = default_voices() + [voice_from_path(p) for p in config.voices]
        # One clause per step (Piper synthesises one text at a time, and a batch would hold every
        # result until its last one is done), two steps at once on the two cores.
        scheduler.add(TTS, TtsEngine(voices, intra_op_threads=config.tts_threads, precision=config.tts_precision),
                      LanePolicy(max_batch=1, concurrency=config.tts_concurrency, step_deadline_s=deadline(TTS)))
        self._add_asr(config, scheduler, deadline)
        # Video decode: one latent step per work item, BULK, so speech runs between any two steps.
        scheduler.add(VIDEO, build_video_engine(config, self.placement, self.metrics),
                      LanePolicy(Priority.BULK, max_batch=1, concurrency=1, step_deadline_s=deadline(VIDEO)))
        # The VAD tick: every window, one batched step over every session's new audio.
        vad = VadEngine(parallel_runs=config.vad_threads)
        denoiser = Denoiser()  # the sessions' noise reduction, in the tick (server/hearing/audio_input.py)
        denoiser.load()
        vad_tick = VadTick(vad, denoiser)
        vad_tick.wake = scheduler.add_tick(VAD, vad, WINDOW_MS, vad_tick.collect, vad_tick.process,
                                           vad_tick.deliver, step_deadline_s=deadline(VAD)).wake
        if config.turn_audio_model:  # semantic_vad's acoustic scorer: single calls (batching gains nothing)
            path = None if config.turn_audio_model == "smart-turn" else config.turn_audio_model
            scheduler.add(TURN_AUDIO, AcousticTurnModel(path),
                          LanePolicy(Priority.REALTIME, max_batch=1, step_deadline_s=deadline(TURN_AUDIO)))
        lanes = {name: scheduler.add_lm(name, engine, deadline(name))
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
        if self.tracing is not None:
            self.tracing.models = {name: model for name, model in (
                ("openai", config.openai_model), ("transformers", config.transformers_model),
                ("llm", f"synthetic-{config.synthetic_lm}" if config.synthetic_lm else "SmolLM2-135M-Instruct"))
                if model and name in responders}
        if config.turn_detection == "semantic_vad" and not self.access.turns.available:
            raise ValueError("turn_detection semantic_vad needs an LM to score the user's words: drop --no-llm "
                             "or give --transformers-model")
        self.realtime = RealtimeService(self.access, max_sessions=config.max_sessions,
                                        lm_slots=config.lm_slots, capacity=config.capacity_sessions,
                                        refuse_at_capacity=config.refuse_at_capacity,
                                        replica=config.replica_name or socket.gethostname(),
                                        defaults=SessionSettings(responder=config.default_responder,
                                                                 turn_type=config.turn_detection,
                                                                 eagerness=config.turn_eagerness,
                                                                 noise_reduction="" if config.noise_reduction == "off"
                                                                 else config.noise_reduction),
                                        limits=Limits(
                                            early_finals=config.early_finals,
                                            turn_thresholds={k: tuple(v) for k, v in
                                                             config.semantic_thresholds.items()},
                                            max_outbox_events=config.session_outbox_events,
                                            max_outbox_bytes=config.session_outbox_bytes,
                                            max_text_chars=config.session_text_chars,
                                            max_instructions_chars=config.session_instructions_chars,
                                            max_id_bytes=config.session_id_bytes,
                                            max_session_s=config.session_max_duration_s,
                                            max_idle_timeout_s=config.session_max_idle_s,
                                            tool_fillers=tuple(config.tool_fillers),
                                            tool_apology=config.tool_apology))
        self.realtime.tracing = self.tracing
        if config.record_dir:  # session recordings (server/observe/recording.py)
            self.realtime.record(Recordings(RecordingPolicy(
                config.record_dir, config.record_on_request, max_bytes=round(config.record_max_mb * MiB),
                max_s=config.record_max_s, retention_h=config.record_retention_h), self.metrics))
        self.private_target: str | None = None  # the in-process web front's own socket (start(private=True))
        self._private_dir: str | None = None
        self.services = SERVICE_NAMES + (RIVA_SERVICE_NAMES if config.riva else [])
        # The lanes each service needs ("": what any service needs; a responder other than the
        # default is not among them): a lane that cannot recover makes those NOT_SERVING.
        reply_lane = config.default_responder if config.default_responder in lanes else \
            f"reply-{config.default_responder}"
        speech_service, realtime_service, video_service = SERVICE_NAMES
        riva_asr, riva_tts = RIVA_SERVICE_NAMES
        self.lanes_needed: dict[str, set[str]] = {
            speech_service: {TTS, ASR, ASR_FINAL},
            realtime_service: {VAD, ASR, ASR_FINAL, TTS, reply_lane},
            video_service: {VIDEO},
            riva_asr: {VAD, ASR, ASR_FINAL},
            riva_tts: {TTS},
        }
        self.lanes_needed[""] = set().union(*(self.lanes_needed[name] for name in self.services))
        scheduler.on_health(self._lanes_changed)
        self.health = health.aio.HealthServicer()
        self.state = "starting"  # then serving; on SIGTERM leaving (drain_delay_s), draining, stopped
        self.ready = False  # health says SERVING for the whole server (read by the metrics port's thread)
        self._beat = time.monotonic()  # the loop's heartbeat, for /livez
        self._heart: asyncio.Task[None] | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None

    def _asr_batch(self, kind: str, decodes: int) -> None:
        self.metrics.asr_decodes.labels(kind).inc(decodes)
        self.metrics.asr_batch.labels(kind).observe(decodes)

    def _add_asr(self, config: ServerConfig, scheduler: Scheduler, deadline: Callable[[str], float | None]) -> None:
        """The recogniser's two lanes: `asr` for audio, `asr_final` for the items that only end
        an utterance, so a turn's final never queues behind other streams' audio."""
        if config.asr == "whisper":
            # One model in this process, running `asr_parallel` batches at once. The `asr` lane has
            # as many runners, each stepping the items of its share of the streams as one batch
            # (sharded by stream, so a stream's items stay in order); `asr_final` has one.
            whisper = build_whisper_engine(config, self.placement, self.metrics, self._asr_batch)
            self.metrics.asr_streams.labels("0").set_function(functools.partial(whisper.streams_on, 0))
            self.metrics.asr_partial_cadence.set_function(lambda: whisper.partial_cadence_ms)
            scheduler.add(ASR, whisper, LanePolicy(Priority.REALTIME, max_batch=256, concurrency=config.asr_parallel,
                                                   shard=lambda item: item.stream.id, step_deadline_s=deadline(ASR)))
            scheduler.add(ASR_FINAL, whisper, LanePolicy(Priority.REALTIME, max_batch=256,
                                                         step_deadline_s=deadline(ASR_FINAL)),
                          lambda items: whisper.step(items, urgent=True))
            return
        # One runner per PocketSphinx worker, each stepping only its own streams' items; the
        # `asr_final` lane's items each worker answers mid-step (its urgent pipe). A worker silent
        # past the lanes' step deadline is killed and restarted, so a hung worker's lane recovers
        # at its deadline.
        silent = max(deadline(ASR) or 0, deadline(ASR_FINAL) or 0) or None
        asr = AsrEngine(workers=config.asr_workers, decoders=config.asr_decoders,
                        on_restart=lambda worker: self.metrics.asr_worker_restarts.labels(str(worker)).inc(),
                        **({"reply_timeout_s": silent} if silent else {}))
        for worker in range(config.asr_workers):  # read when scraped
            self.metrics.asr_streams.labels(str(worker)).set_function(functools.partial(asr.streams_on, worker))
            self.metrics.asr_decoders.labels(str(worker)).set_function(functools.partial(asr.decoders_on, worker))
        for name, step in ((ASR, None), (ASR_FINAL, lambda items: asr.step(items, urgent=True))):
            scheduler.add(name, asr, LanePolicy(Priority.REALTIME, max_batch=64, concurrency=config.asr_workers,
                                                shard=lambda item: item.stream.worker,
                                                step_deadline_s=deadline(name)), step)

    def refusal(self) -> tuple[str, str] | None:
        if self.state in ("serving", "leaving"):
            return None
        if self.state == "starting":
            return "WARMING_UP", "the server is loading its engines; retry shortly"
        return "DRAINING", "the server is shutting down; connect to another replica"

    async def _set_health(self, status: int) -> None:
        self.ready = status == health_pb2.HealthCheckResponse.SERVING
        for name in ["", *self.services]:
            await self.health.set(name, status)

    def http_status(self) -> dict[str, Any]:
        """What the metrics port's /readyz and /livez answer (called from its threads): ready as
        health says for the whole server; live while the event loop keeps beating."""
        state = self.state if self.state != "serving" or self.ready else "unhealthy"
        return {"status": "draining" if state == "leaving" else state, "ready": self.ready,
                "live": time.monotonic() - self._beat < LIVE_WITHIN_S,
                "sessions": len(self.realtime.sessions), "capacity": self.realtime.capacity}

    async def _heartbeat(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(1.0)

    def health_of(self, name: str) -> int:
        """What health says for `name` ("" or a service) now: SERVING only while serving and every
        lane the service needs is healthy."""
        if self.state != "serving" or self.lanes_needed.get(name, set()) & self.scheduler.unhealthy.keys():
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    async def _publish_health(self) -> None:
        self.ready = self.health_of("") == health_pb2.HealthCheckResponse.SERVING
        for name in ["", *self.services]:
            await self.health.set(name, self.health_of(name))

    async def _lanes_changed(self, unhealthy: dict[str, str]) -> None:
        """The scheduler's health watch: the set of unhealthy lanes changed (it logged which)."""
        if self.state == "serving":  # starting and draining say NOT_SERVING whatever the lanes
            await self._publish_health()

    def reload(self) -> TokenTable:
        """SIGHUP: read the TLS certificate and the token file again (a bad file keeps the old one,
        and says so); live sessions go on. Returns the token table in force."""
        if self.tls is not None:
            self.tls.reload()
        try:
            self.tokens = self.auth.tokens = self.tokens.reloaded()
            log.info("tokens reloaded", extra={"tokens": len(self.tokens.tokens)})
        except ValueError as exc:
            log.error("token reload failed, keeping the previous tokens: %s", exc)
        return self.tokens

    async def start(self, private: bool = False) -> int:
        """`private`: also listen on a unix socket in a directory only this user can enter (its
        target in `private_target`), for the web front running in this process."""
        self._heart = asyncio.create_task(self._heartbeat(), name="server-heartbeat")
        server = grpc.aio.server(
            options=grpc_options(self.config),
            interceptors=[ServerInterceptor(self.metrics, self.refusal), self.auth,
                          *([RpcTracing(self.tracing)] if self.tracing is not None else [])],
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
        address = f"{self.config.host}:{self.config.port}"
        if self.tls is not None:
            self.port = server.add_secure_port(address, self.tls.credentials())
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        if private:
            self._private_dir = tempfile.mkdtemp(prefix="rtmedia-")  # mode 0700
            self.private_target = f"unix:{self._private_dir}/grpc.sock"
            server.add_insecure_port(self.private_target)
        await server.start()
        self._server = server
        log.info("listening", extra={"host": self.config.host, "port": self.port, "tls": self.tls is not None,
                                     "mutual_tls": bool(self.config.tls_client_ca), "auth": self.tokens.enabled})
        where = self.placement.describe()
        log.info("engines on %s: LM %s, CUDA graphs %s", where["device"], where["lm_dtype"],
                 "on" if where["cuda_graphs"] else "off", extra=where)
        await self.scheduler.load()
        self.scheduler.start()
        self.realtime.start()
        self.state = "serving"
        await self._publish_health()
        log.info("serving", extra={"port": self.port, "services": self.services})
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new calls (after drain_delay_s, during which they are still
        admitted), let active ones finish within the grace period, the delay included."""
        if self.state == "stopped":
            return
        grace = self.config.grace_s if grace is None else grace
        started = time.monotonic()
        if self.state == "serving" and self.config.drain_delay_s and grace:
            # Not ready at once, still admitting: a proxy polling readiness stops routing here
            # before any session would be refused.
            self.state = "leaving"
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            log.info("not ready; admitting sessions for the drain delay",
                     extra={"drain_delay_s": self.config.drain_delay_s})
            await asyncio.sleep(min(self.config.drain_delay_s, grace))
        self.state = "draining"
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = started + grace  # the delay counts against the grace period
        await self.realtime.drain(max(0.0, deadline - time.monotonic()))
        if self._server is not None:  # other calls get what is left of the grace period
            await self._server.stop(max(1.0, deadline - time.monotonic()))
        await self.realtime.close()
        await self.scheduler.close()
        if self._heart is not None:
            self._heart.cancel()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
        if self.tracing is not None:  # the spans still batched go out (off the loop: it blocks)
            await asyncio.to_thread(self.tracing.shutdown)
        self.state = "stopped"
        log.info("stopped")


async def serve(config: ServerConfig,
                beside: Callable[[ServerConfig, str, TokenTable], Awaitable[Any]] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain gracefully; SIGHUP reloads the certificates and tokens.
    `beside(config, target, tokens)` starts what runs next to the server once it serves (the web
    front; the entry module passes it), dialling `target` (the server's private socket), and
    returns an object with `reload(tokens)`, `async drain(grace_s)` and `async stop()`."""
    server = RtmediaServer(config)
    if config.metrics_port:
        start_metrics_http(config.metrics_host, config.metrics_port, server.metrics.registry, server.http_status)
        log.info("metrics", extra={"host": config.metrics_host, "port": config.metrics_port})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bridge = None

    def reload() -> None:
        tokens = server.reload()
        if bridge is not None:
            bridge.reload(tokens)

    loop.add_signal_handler(signal.SIGHUP, reload)
    starting = asyncio.create_task(server.start(private=beside is not None), name="server-start")
    stopping = asyncio.create_task(stop.wait(), name="stop-signal")
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a failed start raises here
            if beside is not None:
                assert server.private_target is not None
                bridge = await beside(config, server.private_target, server.tokens)
            await stopping
        log.info("signal received: draining", extra={"grace_s": config.grace_s})
    finally:
        for task in (starting, stopping):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        loop.remove_signal_handler(signal.SIGHUP)
        # The bridge's peers are sessions of this server: both drain together, within the grace.
        await asyncio.gather(server.stop(), *([bridge.drain(config.grace_s)] if bridge is not None else []))
        if bridge is not None:
            await bridge.stop()
