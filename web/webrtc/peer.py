"""One browser peer of the WebRTC bridge: a peer connection tied to one Converse session.

The peer owns its tasks and ends them all in `close()`:

- `mic`: the browser's microphone track, resampled to the session's input rate and
  sent as `input_audio_buffer.append`;
- `writer`: the one task that writes to the Converse stream (mic audio, events from
  the page, playback acks), in order;
- `reader`: server events; reply audio goes into the playout buffer, everything else
  (and a light form of the audio deltas) to the page on the `events` data channel;
  `output_audio_buffer.cleared` empties the playout buffer at once; `speech_tentative` pauses
  it until the voice is judged (`backchannel` or `speech_started`);
- `acks`: `playback.ack` from what the outgoing audio track has actually played out;
- `video`: a demo `DecodeVideo` whose frames go out on the video track;
- `connect`: the connect deadline (`expect_connection`): a peer whose connection is not up
  by then is closed, so one that never connects holds its bridge slot and session no longer.

Every call the peer makes to the server carries `metadata` (`authorization: Bearer TOKEN`:
the token its browser presented, else the bridge's --server-token); `token_name` is the NAME
of the bridge's token the browser presented (web/bridge.py), for its logs and statistics:
never the token.

The page speaks canonical JSON (docs/protocol.md#events) on the `events` channel. Messages whose
type starts with `bridge.` are the bridge's own (docs/protocol.md#events):
`bridge.video.request` from the page; `bridge.peer`, `bridge.playback.cleared`,
`bridge.video.*` and `bridge.error` to it.

A call of OpenAI's Realtime API (`POST /v1/realtime/calls`, rtmedia.web.openai.realtime_calls) is a
peer with a `translator` (rtmedia.web.openai.realtime_events): its `oai-events` channel speaks the
API's events, the same media path carries the audio, and `output_audio_buffer.stopped` comes
when the outgoing track has played a reply out. Control sockets (`realtime.connect(call_id=...)`)
attached to the call (`attach`) see the same events and may send the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from aiortc import RTCPeerConnection
from aiortc.jitterbuffer import JitterBuffer
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from rtmedia.clients.errors import RtmediaError
from rtmedia.protocol.events import EventError, client_event, event_type, from_json, to_json
from rtmedia.v1 import realtime_pb2, video_pb2
from rtmedia.v1.video_pb2_grpc import VideoServiceStub
from rtmedia.web.door import OPEN_TIMEOUT_S, Door, Fault, fault_of, on
from rtmedia.web.openai.realtime_config import RealtimeError
from rtmedia.web.openai.realtime_events import Translator
from rtmedia.web.playout import ReplyPlayout
from rtmedia.web.webrtc.tracks import (
    PLAYOUT_RATE,
    MicResampler,
    PacketAudioBuffer,
    ReplyAudioTrack,
    VideoFrameTrack,
)

log = logging.getLogger("rtmedia.web")

ACK_TICK_S = 0.05
MAX_PENDING_MESSAGES = 1000  # events queued for the page before its channel opens
MAX_LATENT_VALUES = 4 * 1024 * 1024
# Session settings the bridge owns: the page cannot change the audio formats of the tracks.
BRIDGE_OWNED = ("input_audio_format", "output_sample_rate")


class OfferError(Exception):
    """An offer the bridge does not answer; `status` is the HTTP status to answer with, `headers`
    extra response headers (Retry-After, WWW-Authenticate), `reason` a machine-readable word
    for the JSON body (None: none)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.reason = reason


class SessionRefused(OfferError):
    """The rtmedia server would not open a session."""


@dataclass
class VideoDefaults:
    latent_shape: tuple[int, int, int, int] = (16, 5, 8, 8)  # C x T x H x W
    fps: float = 8.0


@dataclass
class PeerStats:
    mic_frames: int = 0
    mic_bytes: int = 0
    events_to_page: int = 0
    events_from_page: int = 0
    acks: int = 0
    dropped_to_page: int = 0
    video_frames: int = 0
    opened_at: float = field(default_factory=time.perf_counter)


class Peer(Door):
    """A browser's peer connection and its Converse session: the page's events, the microphone and
    the acks are queued for the session (`outgoing`), its events answered by the `@on` handlers."""

    open_timeout_s = OPEN_TIMEOUT_S

    def __init__(self, peer_id: str, pc: RTCPeerConnection, channel: grpc.aio.Channel, input_rate: int,
                 video: VideoDefaults, on_closed: Callable[[Peer], None],
                 metadata: tuple[tuple[str, str], ...] = (), token_name: str | None = None,
                 translator: Translator | None = None) -> None:
        super().__init__()
        self.id = peer_id  # the peer's capability: only its own client knows it (web/bridge.py)
        self.tag = peer_id[:8]  # what logs and task names call it
        self.metadata = metadata  # sent on every call to the server (the bearer token: never logged)
        self.token_name = token_name  # the NAME of the web token its client presented, None without one
        self.pc = pc
        self.grpc_channel = channel
        self.input_rate = input_rate
        self.video_defaults = video
        self._on_closed = on_closed
        self.playout = ReplyPlayout(PLAYOUT_RATE)
        self.buffer = self.playout.buffer
        self.mic_buffers: list[JitterBuffer] = []  # the microphone's receive buffers (set_audio_prefetch)
        self.audio_out = ReplyAudioTrack(self.buffer)
        self.video_out = VideoFrameTrack()
        self.stats = PeerStats()
        self.session_id = ""
        self.close_reason = ""
        self.closed = asyncio.Event()
        self._closing = False
        self._connected = asyncio.Event()  # the peer connection (ICE and DTLS) has been up
        self._channel: Any = None  # the `events` RTCDataChannel
        self._pending: deque[str] = deque()
        self._session_open = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cleared: Any = None  # what the playout did at the event being dispatched (a barge-in's clear)
        self.translator = translator
        self.label = "oai-events" if translator is not None else "events"
        self.sidebands: set[asyncio.Queue[str | None]] = set()  # attached control sockets' outboxes
        pc.on("track", self._on_track)
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)
        pc.on("iceconnectionstatechange", self._on_ice_state)

    # ---- life cycle -------------------------------------------------------------------------------
    async def open_session(self, settings: dict[str, Any]) -> None:
        """Open the Converse stream, wait for session.created, then configure it.
        Raises SessionRefused when the server does not take the session."""
        session = {**settings, "input_audio_format": {"encoding": "pcm16", "sample_rate": self.input_rate,
                                                     "channels": 1},
                   "output_sample_rate": PLAYOUT_RATE}
        configure = client_event("session.update", event_id="bridge-config", session=session) \
            if self.translator is None else self.translator.initial()
        try:
            first = await self.open_converse(self.grpc_channel, self.metadata)
            assert self.session is not None
            await self.session.send(configure)
        except (TimeoutError, RtmediaError) as exc:
            if self.session is not None:
                self.session.cancel_stream()
            raise _refusal(fault_of(exc)) from None
        self.session_id = first.session_id
        self.to_page_event(first.proto)
        self._session_open.set()
        self._start("reader", self.pump_output)
        self._start("writer", self.pump_input)
        self._start("acks", self._ack_loop)

    def expect_connection(self, timeout_s: float) -> None:
        """Close the peer unless its connection (ICE and DTLS) is up within `timeout_s`: an
        answered peer holds a bridge slot and a session, which a browser that went away, or an
        offer that can never connect, must not keep."""
        self._start("connect", self._connect_deadline, timeout_s)

    async def _connect_deadline(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        except TimeoutError:
            await self.close(f"not connected within {timeout_s:g} s")

    def _start(self, name: str, run: Callable[..., Any], *args: Any) -> None:
        # The coroutine is made inside the task: a task cancelled before it runs leaves none un-awaited.
        self._tasks[name] = asyncio.create_task(self._guard(name, run, *args), name=f"peer-{self.tag}-{name}")

    async def _guard(self, name: str, run: Callable[..., Any], *args: Any) -> None:
        try:
            await run(*args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("peer task failed", extra={**self.log_fields, "task": name})
            self.send_bridge("bridge.error", code="internal_error", message=f"{name}: {type(exc).__name__}: {exc}")
            self.schedule_close(f"{name} failed")

    def schedule_close(self, reason: str) -> None:
        if not self._closing:
            asyncio.get_running_loop().create_task(self.close(reason), name=f"peer-{self.tag}-close")

    async def close(self, reason: str) -> None:
        """End the session and the peer connection; idempotent."""
        if self._closing:
            await self.closed.wait()
            return
        self._closing = True
        self.close_reason = reason
        log.info("peer closing", extra={**self.log_fields, "session_id": self.session_id, "reason": reason})
        current = asyncio.current_task()
        tasks = [t for t in self._tasks.values() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            self.session.cancel_stream()  # the server frees the session's resources (docs/protocol.md#admission-and-lifecycle)
        self.audio_out.stop()
        self.video_out.stop()
        for sideband in self.sidebands:
            sideband.put_nowait(None)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.pc.close(), 5)
        self.closed.set()
        self._on_closed(self)

    @property
    def log_fields(self) -> dict[str, str]:
        """What every log line about this peer carries: its tag, and its token's name if any."""
        return {"peer": self.tag, **({"token_name": self.token_name} if self.token_name else {})}

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self._connected.set()
        if state in ("failed", "closed"):
            self.schedule_close(f"peer connection {state}")

    def _on_ice_state(self) -> None:
        if self.pc.iceConnectionState == "failed":
            self.schedule_close("ICE failed")

    # ---- browser -> server ------------------------------------------------------------------------------
    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio" and "mic" not in self._tasks:
            self._start("mic", self._pump_mic, track)

    async def _pump_mic(self, track: MediaStreamTrack) -> None:
        await self._session_open.wait()
        resampler = MicResampler(self.input_rate)
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return  # the browser stopped sending
            pcm = resampler.resample(frame)  # cheap next to a thread hop: stays on the loop
            self.stats.mic_frames += 1
            if pcm:
                self.stats.mic_bytes += len(pcm)
                await self.outgoing.put(client_event("input_audio_buffer.append", audio=pcm))

    def _on_datachannel(self, channel: Any) -> None:
        if channel.label != self.label:
            return
        self._channel = channel
        channel.on("message", self._on_page_message)
        channel.on("open", self._flush_pending)
        if channel.readyState == "open":
            self._flush_pending()

    def _on_page_message(self, message: str | bytes) -> None:
        self.stats.events_from_page += 1
        if self.translator is not None:
            self.on_api_message(message)
            return
        try:
            obj = json.loads(message)
        except RecursionError:
            self.send_bridge("bridge.error", code="invalid_event", message="event is nested too deeply")
            return
        except ValueError as exc:
            self.send_bridge("bridge.error", code="invalid_event", message=f"event is not valid JSON: {exc}")
            return
        if isinstance(obj, dict) and isinstance(obj.get("type"), str) and obj["type"].startswith("bridge."):
            self._on_bridge_request(obj)
            return
        event_id = obj.get("event_id", "") if isinstance(obj, dict) else ""
        event_id = event_id if isinstance(event_id, str) else ""
        try:
            request = from_json(obj, "client")
            self._check_page_event(request)
        except EventError as exc:
            self.to_page(to_json(exc.to_event(event_id)))
            return
        if not self.put(request):
            self.to_page(to_json(EventError("input_backpressure", "the bridge's queue to the server is full; "
                                                                  "event dropped").to_event(event_id)))

    def on_api_message(self, message: str | bytes) -> None:
        """An event of the Realtime API, from the call's channel or a control socket."""
        assert self.translator is not None
        try:
            requests, local = self.translator.from_client(json.loads(message))
        except RealtimeError as exc:
            self.to_page(self.translator.error(exc, getattr(exc, "event_id", None)))
            return
        except (ValueError, RecursionError) as exc:
            self.to_page(self.translator.error(RealtimeError("invalid_json", f"the event is not valid JSON: "
                                                                             f"{str(exc)[:120]}")))
            return
        for request in requests:
            if not self.put(request):
                self.to_page(self.translator.error(RealtimeError(
                    "input_backpressure", "the call's queue to the server is full; the event was dropped"),
                    request.event_id))
        for event in local:
            self.to_page(event)

    def _check_page_event(self, request: realtime_pb2.ConverseRequest) -> None:
        name = event_type(request)
        if name == "playback.ack":
            raise EventError("invalid_event", "playback.ack is sent by the bridge from its own playout; "
                                              "the page must not send it", "type")
        if name == "session.update":
            for key in BRIDGE_OWNED:
                if request.session_update.session.HasField(key):
                    raise EventError("invalid_value", f"session.{key} is set by the bridge (its audio tracks "
                                                      "fix the formats) and cannot be changed", f"session.{key}")

    def _on_bridge_request(self, obj: dict[str, Any]) -> None:
        if obj["type"] != "bridge.video.request":
            self.send_bridge("bridge.error", code="unknown_event",
                             message=f"unknown bridge event {obj['type'][:64]!r}; known: bridge.video.request")
            return
        try:
            shape, fps, seed = self._video_request(obj)
        except ValueError as exc:
            self.send_bridge("bridge.video.error", code="invalid_value", message=str(exc))
            return
        running = self._tasks.get("video")
        if running is not None and not running.done():
            self.send_bridge("bridge.video.error", code="busy", message="a video decode is already running")
            return
        self._start("video", self._decode_video, shape, fps, seed)

    # ---- server -> browser ------------------------------------------------------------------------------
    async def on_fault(self, fault: Fault) -> None:
        if fault.kind == "cancelled" and self._closing:
            return
        if fault.kind == "ended":
            # After session.closed (the session's last event) the stream only ends. grpc.aio may turn
            # that end into INTERNAL when a write raced it (grpc/grpc#36066): it ended as the server said.
            self.schedule_close("session ended")
            return
        self.send_bridge("bridge.error", code=fault.code.name.lower(), message=f"the rtmedia session ended: "
                         f"{fault.details}" + (f" ({fault.reason})" if fault.reason else ""))
        self.schedule_close(f"server error {fault.code.name}")

    async def on_stream_end(self) -> None:
        self.schedule_close("session ended")

    async def dispatch(self, msg: realtime_pb2.ConverseResponse) -> bool | None:
        self._cleared = self.playout.on_event(msg)  # the playout sees every event first
        return await super().dispatch(msg)

    @on("response.output_audio.delta")
    def _audio_delta(self, msg: realtime_pb2.ConverseResponse) -> None:
        if self.translator is not None:
            self.to_page_event(msg)
            return
        # The audio travels on the media track; the page gets the delta without its bytes.
        light = realtime_pb2.ConverseResponse()
        light.CopyFrom(msg)
        light.response_output_audio_delta.audio = b""
        obj = to_json(light)
        obj["audio_bytes"] = len(msg.response_output_audio_delta.audio)
        obj.pop("audio", None)
        self.to_page(obj)

    @on("session.closed")
    def _session_closed(self, msg: realtime_pb2.ConverseResponse) -> None:
        self.close_reason = msg.session_closed.reason
        self.to_page_event(msg)

    @on("output_audio_buffer.cleared")
    def _playback_cleared(self, msg: realtime_pb2.ConverseResponse) -> None:
        self.to_page_event(msg)
        cleared = self._cleared
        if cleared is not None:
            self.send_bridge("bridge.playback.cleared", response_id=cleared.response_id,
                             dropped_ms=cleared.dropped_ms, played_ms=cleared.played_ms)

    def on_event(self, name: str, msg: realtime_pb2.ConverseResponse) -> None:
        self.to_page_event(msg)

    async def _ack_loop(self) -> None:
        """playback.ack every ~200 ms of played audio, and once a reply has played out (or was cut)."""
        while True:
            await asyncio.sleep(ACK_TICK_S)
            due, finished = self.playout.acks()
            for rid, played in due:
                self.stats.acks += 1
                await self.outgoing.put(client_event("playback.ack", response_id=rid, played_ms=played))
            if self.translator is not None:
                for rid in finished:
                    self.to_page(self.translator.stopped(rid))

    def to_page_event(self, msg: realtime_pb2.ConverseResponse) -> None:
        """A server event to the page: as it is, or as the Realtime API's events."""
        if self.translator is None:
            self.to_page(to_json(msg))
            return
        for event in self.translator.from_server(msg):
            self.to_page(event)

    def to_page(self, obj: dict[str, Any]) -> None:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        for sideband in list(self.sidebands):
            try:
                sideband.put_nowait(text)
            except asyncio.QueueFull:  # a control socket that does not read is let go
                self.sidebands.discard(sideband)
                while not sideband.empty():
                    sideband.get_nowait()
                sideband.put_nowait(None)
        channel = self._channel
        if channel is not None and channel.readyState == "open":
            channel.send(text)
            self.stats.events_to_page += 1
            return
        if len(self._pending) >= MAX_PENDING_MESSAGES:
            self._pending.popleft()
            self.stats.dropped_to_page += 1
        self._pending.append(text)

    def send_bridge(self, name: str, **fields: Any) -> None:
        if self.translator is not None:  # a call hears of the bridge's trouble as the API's error
            if name == "bridge.error":
                self.to_page(self.translator.error(RealtimeError(fields.get("code", "server_error"),
                                                                 fields.get("message", ""), type="server_error")))
            return
        self.to_page({"type": name, **fields})

    def _flush_pending(self) -> None:
        self.send_bridge("bridge.peer", peer_id=self.id, session_id=self.session_id, input_sample_rate=self.input_rate,
                         output_sample_rate=PLAYOUT_RATE)
        pending, self._pending = self._pending, deque()
        for text in pending:
            self._channel.send(text)
            self.stats.events_to_page += 1

    # ---- video --------------------------------------------------------------------------------------------
    def _video_request(self, obj: dict[str, Any]) -> tuple[list[int], float, int]:
        """The checked latent_shape, fps and seed of a bridge.video.request."""
        unknown = sorted(set(obj) - {"type", "latent_shape", "fps", "seed"})
        if unknown:
            raise ValueError(f"unknown field(s) in bridge.video.request: {', '.join(unknown)}")
        shape = obj.get("latent_shape", list(self.video_defaults.latent_shape))
        if (not isinstance(shape, list) or len(shape) != 4
                or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
            raise ValueError(f"latent_shape must be four positive integers (C, T, H, W), got {shape!r}")
        if int(np.prod(shape)) > MAX_LATENT_VALUES:
            raise ValueError(f"latent_shape {shape} has more than {MAX_LATENT_VALUES} values")
        fps = obj.get("fps", self.video_defaults.fps)
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= 120:
            raise ValueError(f"fps must be a number in (0, 120], got {fps!r}")
        seed = obj.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        return shape, float(fps), seed

    async def _decode_video(self, shape: list[int], fps: float, seed: int) -> None:
        if not any(t.sender.track is self.video_out for t in self.pc.getTransceivers()):
            self.send_bridge("bridge.video.error", code="no_video_track",
                             message="the offer had no video section, so there is no track to show video on")
            return
        # Up to MAX_LATENT_VALUES normal draws (16 MiB): too long for the loop that paces the tracks.
        request = await asyncio.to_thread(_latent_request, shape, fps, seed)
        self.video_out.restart_clip()
        self.send_bridge("bridge.video.started", latent_shape=shape, fps=fps)
        frames = 0
        started = time.perf_counter()
        try:
            async for chunk in VideoServiceStub(self.grpc_channel).DecodeVideo(request,
                                                                               metadata=self.metadata or None):
                count = chunk.part_frame_count or chunk.frame_count
                size = count * chunk.height * chunk.width * 3
                if chunk.format not in (video_pb2.VIDEO_FORMAT_UNSPECIFIED, video_pb2.VIDEO_FORMAT_RAW_RGB24) \
                        or len(chunk.data) != size:
                    raise ValueError(f"chunk {chunk.chunk_index}: expected {count} RGB24 frames of "
                                     f"{chunk.width}x{chunk.height} ({size} bytes), got {len(chunk.data)} bytes")
                self.send_bridge("bridge.video.chunk", chunk_index=chunk.chunk_index, total_chunks=chunk.total_chunks,
                                 frame_start=chunk.part_frame_start or chunk.frame_start, frame_count=count,
                                 width=chunk.width, height=chunk.height, is_final=chunk.is_final,
                                 t_ms=round((time.perf_counter() - started) * 1000, 1))
                fps = chunk.fps or request.fps
                video = np.frombuffer(chunk.data, np.uint8).reshape(count, chunk.height, chunk.width, 3)
                for frame in video:
                    await self.video_out.put(frame, fps)  # waits while the track's queue is full
                    frames += 1
                    self.stats.video_frames += 1
        except grpc.aio.AioRpcError as exc:
            self.send_bridge("bridge.video.error", code=exc.code().name.lower(),
                             message=exc.details() or exc.code().name, frames=frames)
            return
        except ValueError as exc:
            self.send_bridge("bridge.video.error", code="invalid_chunk", message=str(exc), frames=frames)
            return
        self.send_bridge("bridge.video.done", frames=frames, t_ms=round((time.perf_counter() - started) * 1000, 1))

    @property
    def late_mic_packets(self) -> int:
        return sum(b.late for b in self.mic_buffers if isinstance(b, PacketAudioBuffer))

    def describe(self) -> dict[str, Any]:
        """The peer's statistics, for its own client (GET /peers/{id})."""
        return {"session_id": self.session_id, "token_name": self.token_name,
                "connection_state": self.pc.connectionState,
                "playout": vars(self.buffer.stats) | {"queued_ms": round(self.buffer.queued_ms)},
                "stats": {k: v for k, v in vars(self.stats).items() if k != "opened_at"},
                "late_mic_packets": self.late_mic_packets,
                "age_s": round(time.perf_counter() - self.stats.opened_at, 1)}


def _latent_request(shape: list[int], fps: float, seed: int) -> video_pb2.DecodeVideoRequest:
    """A DecodeVideo request of a seeded random latent (the demo video)."""
    latent = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    tensor = video_pb2.Tensor(shape=shape, dtype=video_pb2.TENSOR_DTYPE_FLOAT32, data=latent.tobytes())
    return video_pb2.DecodeVideoRequest(latent=tensor, fps=fps, format=video_pb2.VIDEO_FORMAT_RAW_RGB24)


def retry_after(value: str | None) -> dict[str, str]:
    """A Retry-After header (whole seconds, rounded up) from ErrorInfo's retry_after_s; {} without one."""
    try:
        seconds = math.ceil(float(value)) if value is not None else None
    except (ValueError, OverflowError):
        seconds = None
    return {"Retry-After": str(max(1, seconds))} if seconds is not None and seconds < 10**9 else {}


def _refusal(fault: Fault) -> SessionRefused:
    """The answer to an offer whose session the server would not open (the doors' error mapping)."""
    detail = fault.summary
    if fault.kind == "timeout":
        return SessionRefused(504, f"the rtmedia server did not open a session within {OPEN_TIMEOUT_S:.0f} s")
    if fault.kind == "unauthenticated":
        # What the server said stays in the bridge's log ("offer refused"); the client is told no more
        # than that a valid token is wanted.
        log.info("the rtmedia server refused the credentials", extra={"error": detail[:300]})
        return SessionRefused(401, "authentication required: send Authorization: Bearer TOKEN",
                              {"WWW-Authenticate": "Bearer"}, "unauthenticated")
    if fault.kind == "forbidden":
        return SessionRefused(403, f"the rtmedia server does not allow this session: {detail}", reason="forbidden")
    if fault.kind == "quota":
        return SessionRefused(429, f"over the token's quota: {detail}",
                              retry_after(fault.metadata.get("retry_after_s")), "quota")
    if fault.kind == "refused":
        return SessionRefused(503, f"the rtmedia server refused the session: {detail}")
    if fault.kind == "unreachable":
        return SessionRefused(502, f"cannot reach the rtmedia server: {detail}")
    return SessionRefused(502, f"the rtmedia server failed to open a session: {detail}")
