"""The rtmedia server process: gRPC services, health, reflection, metrics, drain.

Health says SERVING only while the server serves (not while it starts or drains) and, for the
server ("") and each service, only while every lane it needs is healthy (the scheduler's health
watch, server/lanes/scheduler.py): a lane that cannot recover takes the services that use it out of
a load balancer's rotation until it recovers."""

from __future__ import annotations

import asyncio
import contextlib
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
from rtmedia.engines.audio.denoise import Denoiser
from rtmedia.engines.responders.contract import Responder
from rtmedia.engines.responders.openai_chat import OpenAIResponder
from rtmedia.engines.tts.piper import TtsEngine, default_voices, voice_from_path
from rtmedia.engines.turn.scorers import AcousticTurnModel
from rtmedia.engines.vad.silero import VadEngine
from rtmedia.protocol.tokens import TokenTable
from rtmedia.protocol.turn_kinds import SEMANTIC_VAD
from rtmedia.server.config import MiB, ServerConfig
from rtmedia.server.hearing.audio_input import WINDOW_MS, VadTick
from rtmedia.server.lanes.access import ASR, ASR_FINAL, TTS, TURN_AUDIO, VAD, VIDEO, EngineAccess
from rtmedia.server.lanes.lm_lane import LmLane
from rtmedia.server.lanes.placement import (
    build_lm_engines,
    build_video_engine,
    placement,
)
from rtmedia.server.lanes.recognizer import add_asr
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
        ("grpc.max_receive_message_length", config.network.max_receive_bytes),
        ("grpc.max_send_message_length", config.network.max_send_bytes),
        # Ping idle connections every 30 s so dead peers (NAT, mobile) are noticed
        # within ~40 s; let clients ping as often as every 10 s, even without calls.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 0),
        *([("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", config.network.stream_window_bytes)]
          if config.network.stream_window_bytes else []),
    ]


class RtmediaServer:
    """Builds the engines and services; `start()` binds, loads, warms, then says SERVING."""

    def __init__(self, config: ServerConfig, metrics: Metrics | None = None, tracing: Tracing | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        # Traces (server/observe/tracing.py): this server's own provider, or None (off: nothing is set up).
        # Read first, so a bad OTEL_* protocol or endpoint stops the start at once with one line.
        export = tracing_from_env(config.tracing.endpoint)
        self.tracing = tracing if tracing is not None else Tracing.exporting(export) if export else None
        # Read first, so a bad file stops the start at once with one line naming it.
        auth = config.auth
        self.tls = ServerTls(auth.tls_cert, auth.tls_key, auth.tls_client_ca) if auth.tls_cert else None
        self.tokens = TokenTable.load(config.auth.auth_tokens)
        self.auth = AuthInterceptor(self.tokens, lambda reason: self.metrics.auth_refused.labels(reason).inc())
        self.placement = placement(config)  # device, precision, CUDA graphs (server/lanes/placement.py)
        self.scheduler = scheduler = Scheduler(self.metrics, unhealthy_after_s=config.lanes.unhealthy_after_s)
        vad, vad_tick, lanes = self._add_lanes(config)
        responders = self._add_responders(config, lanes)
        self.access = EngineAccess.of(scheduler, vad, vad_tick, responders)
        if self.tracing is not None:
            self.tracing.models = {name: model for name, model in (
                ("openai", config.openai.model), ("transformers", config.lm.transformers_model),
                ("llm", f"synthetic-{config.lm.synthetic_lm}" if config.lm.synthetic_lm else "SmolLM2-135M-Instruct"))
                if model and name in responders}
        if config.turn.detection == SEMANTIC_VAD and not self.access.turns.available:
            raise ValueError("turn_detection semantic_vad needs an LM to score the user's words: drop --no-llm "
                             "or give --transformers-model")
        self.realtime = self._realtime_service(config)
        self.realtime.tracing = self.tracing
        if config.recording.dir:  # session recordings (server/observe/recording.py)
            self.realtime.record(Recordings(RecordingPolicy(
                config.recording.dir, config.recording.on_request, max_bytes=round(config.recording.max_mb * MiB),
                max_s=config.recording.max_s, retention_h=config.recording.retention_h), self.metrics))
        self.private_target: str | None = None  # the in-process web front's own socket (start(private=True))
        self._private_dir: str | None = None
        self.services = SERVICE_NAMES + (RIVA_SERVICE_NAMES if config.network.riva else [])
        self.lanes_needed = self._lanes_needed(config, lanes)
        scheduler.on_health(self._lanes_changed)
        self.health = health.aio.HealthServicer()
        self.state = "starting"  # then serving; on SIGTERM leaving (drain_delay_s), draining, stopped
        self.ready = False  # health says SERVING for the whole server (read by the metrics port's thread)
        self._beat = time.monotonic()  # the loop's heartbeat, for /livez
        self._heart: asyncio.Task[None] | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None

    def _add_lanes(self, config: ServerConfig) -> tuple[VadEngine, VadTick, dict[str, LmLane]]:
        """Every engine's lane: TTS, the recogniser's two, video, the VAD tick, the acoustic turn
        scorer when asked for, and one LM lane per LM engine."""
        scheduler = self.scheduler
        deadline = config.step_deadline
        voices = default_voices() + [voice_from_path(p) for p in config.tts.voices]
        # One clause per step (Piper synthesises one text at a time, and a batch would hold every
        # result until its last one is done), two steps at once on the two cores.
        scheduler.add(TTS, TtsEngine(voices, intra_op_threads=config.tts.threads, precision=config.tts.precision),
                      LanePolicy(max_batch=1, concurrency=config.tts.concurrency, step_deadline_s=deadline(TTS)))
        add_asr(config, scheduler, self.placement, self.metrics, deadline)  # server/lanes/recognizer.py
        # Video decode: one latent step per work item, BULK, so speech runs between any two steps.
        scheduler.add(VIDEO, build_video_engine(config, self.placement, self.metrics),
                      LanePolicy(Priority.BULK, max_batch=1, concurrency=1, step_deadline_s=deadline(VIDEO)))
        # The VAD tick: every window, one batched step over every session's new audio.
        vad = VadEngine(parallel_runs=config.vad.threads)
        denoiser = Denoiser()  # the sessions' noise reduction, in the tick (server/hearing/audio_input.py)
        denoiser.load()
        vad_tick = VadTick(vad, denoiser)
        vad_tick.wake = scheduler.add_tick(VAD, vad, WINDOW_MS, vad_tick.collect, vad_tick.process,
                                           vad_tick.deliver, step_deadline_s=deadline(VAD)).wake
        if config.turn.audio_model:  # semantic_vad's acoustic scorer: single calls (batching gains nothing)
            path = None if config.turn.audio_model == "smart-turn" else config.turn.audio_model
            scheduler.add(TURN_AUDIO, AcousticTurnModel(path),
                          LanePolicy(Priority.REALTIME, max_batch=1, step_deadline_s=deadline(TURN_AUDIO)))
        lanes = {name: scheduler.add_lm(name, engine, deadline(name))
                 for name, engine in build_lm_engines(config, self.placement, self.metrics).items()}
        return vad, vad_tick, lanes

    def _add_responders(self, config: ServerConfig, lanes: dict[str, LmLane]) -> dict[str, Responder]:
        """The responders on offer; those that are not an LM lane's get a stream lane each."""
        scheduler = self.scheduler
        extra = {}
        if config.openai.url:
            extra["openai"] = OpenAIResponder(config.openai.url, config.openai.model, os.environ.get("OPENAI_API_KEY"))
        responders = build_responders(lanes, extra)
        if config.lm.default_responder not in responders:
            raise ValueError(f"default_responder {config.lm.default_responder!r} is not available; "
                             f"available: {', '.join(sorted(responders))}")
        for name in responders.keys() - lanes.keys():  # replies that are not an LM lane's: one stream lane each
            scheduler.add_stream(f"reply-{name}", LanePolicy(Priority.INTERACTIVE, concurrency=config.limits.max_sessions))
        return responders

    def _realtime_service(self, config: ServerConfig) -> RealtimeService:
        """Converse's servicer, with the sessions' defaults and limits from the config."""
        return RealtimeService(self.access, max_sessions=config.limits.max_sessions,
                       lm_slots=config.lm.slots, capacity=config.limits.capacity_sessions,
                       refuse_at_capacity=config.limits.refuse_at_capacity,
                       replica=config.network.replica_name or socket.gethostname(),
                       defaults=SessionSettings(responder=config.lm.default_responder,
                                                turn_type=config.turn.detection,
                                                eagerness=config.turn.eagerness,
                                                noise_reduction="" if config.vad.noise_reduction == "off"
                                                else config.vad.noise_reduction),
                       limits=Limits(
                           early_finals=config.asr.early_finals,
                           turn_thresholds={k: tuple(v) for k, v in
                                            config.turn.semantic_thresholds.items()},
                           max_outbox_events=config.limits.outbox_events,
                           max_outbox_bytes=config.limits.outbox_bytes,
                           max_text_chars=config.limits.text_chars,
                           max_instructions_chars=config.limits.instructions_chars,
                           max_id_bytes=config.limits.id_bytes,
                           max_session_s=config.limits.max_duration_s,
                           max_idle_timeout_s=config.limits.max_idle_s,
                           tool_fillers=tuple(config.limits.tool_fillers),
                           tool_apology=config.limits.tool_apology))

    def _lanes_needed(self, config: ServerConfig, lanes: dict[str, LmLane]) -> dict[str, set[str]]:
        """The lanes each service needs ("": what any service needs; a responder other than the
        default is not among them): a lane that cannot recover makes those NOT_SERVING."""
        reply_lane = config.lm.default_responder if config.lm.default_responder in lanes else \
            f"reply-{config.lm.default_responder}"
        speech_service, realtime_service, video_service = SERVICE_NAMES
        riva_asr, riva_tts = RIVA_SERVICE_NAMES
        needed: dict[str, set[str]] = {
            speech_service: {TTS, ASR, ASR_FINAL},
            realtime_service: {VAD, ASR, ASR_FINAL, TTS, reply_lane},
            video_service: {VIDEO},
            riva_asr: {VAD, ASR, ASR_FINAL},
            riva_tts: {TTS},
        }
        needed[""] = set().union(*(needed[name] for name in self.services))
        return needed

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
            SpeechService(self.access, self.config.network.max_text_chars), server
        )
        realtime_pb2_grpc.add_RealtimeServiceServicer_to_server(self.realtime, server)
        video_pb2_grpc.add_VideoServiceServicer_to_server(
            VideoService.from_config(self.access, self.config), server
        )
        if self.config.network.riva:  # NVIDIA Riva's speech API on the same engines
            riva_asr_pb2_grpc.add_RivaSpeechRecognitionServicer_to_server(
                RivaAsrService(self.access), server)
            riva_tts_pb2_grpc.add_RivaSpeechSynthesisServicer_to_server(
                RivaTtsService(self.access, self.config.network.max_text_chars), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [*self.services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.network.host}:{self.config.network.port}"
        if self.tls is not None:
            self.port = server.add_secure_port(address, self.tls.credentials())
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {self.config.network.host}:{self.config.network.port}")
        if private:
            self._private_dir = tempfile.mkdtemp(prefix="rtmedia-")  # mode 0700
            self.private_target = f"unix:{self._private_dir}/grpc.sock"
            server.add_insecure_port(self.private_target)
        await server.start()
        self._server = server
        log.info("listening", extra={"host": self.config.network.host, "port": self.port, "tls": self.tls is not None,
                                     "mutual_tls": bool(self.config.auth.tls_client_ca), "auth": self.tokens.enabled})
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
        grace = self.config.network.grace_s if grace is None else grace
        started = time.monotonic()
        if self.state == "serving" and self.config.network.drain_delay_s and grace:
            # Not ready at once, still admitting: a proxy polling readiness stops routing here
            # before any session would be refused.
            self.state = "leaving"
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            log.info("not ready; admitting sessions for the drain delay",
                     extra={"drain_delay_s": self.config.network.drain_delay_s})
            await asyncio.sleep(min(self.config.network.drain_delay_s, grace))
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
    if config.network.metrics_port:
        start_metrics_http(config.network.metrics_host, config.network.metrics_port, server.metrics.registry, server.http_status)
        log.info("metrics", extra={"host": config.network.metrics_host, "port": config.network.metrics_port})
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
        log.info("signal received: draining", extra={"grace_s": config.network.grace_s})
    finally:
        for task in (starting, stopping):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        loop.remove_signal_handler(signal.SIGHUP)
        # The bridge's peers are sessions of this server: both drain together, within the grace.
        await asyncio.gather(server.stop(), *([bridge.drain(config.network.grace_s)] if bridge is not None else []))
        if bridge is not None:
            await bridge.stop()
