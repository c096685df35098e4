"""The SIP door (docs/telephony.md#sip): phone calls over SIP and RTP on PJSIP (`pjsua2`), one
`Converse` session per call, a gRPC client of the server like the web bridge.

It runs as a process of its own (`rtmedia sip`, or beside `rtmedia serve --sip`). PJSIP is
created with no worker threads and `mainThreadOnly`: its SIP events are handled in this
process's event loop by `SipDoor.poll` (`libHandleEvents`), so every call to PJSIP's API and
every SIP callback runs on the loop. Only the media clock is PJSIP's own thread (the null
sound device's conference bridge, every 20 ms): it hands each call's `CallPort` the caller's
decoded frame (after the jitter buffer) and takes the next frame of the reply. The port queues
the first for the loop (`inbound`, a deque) and takes the second from the call's
`ReplyPlayout` under its lock; nothing else crosses threads.

A call: the INVITE is checked (draining: 503; over `max_calls`, or its trunk's: 486; the accept
rules and hook: 403 or the hook's status), answered 180, its session opened (the server
refusing: 503), then answered 200. Its audio is 20 ms PCM at the codec's rate (8 kHz for
G.711, 16 kHz for G.722); the reply is paced by the media clock and acknowledged from what the
clock took (`playback.ack`), so a barge-in truncates at what the caller heard. DTMF (RFC 4733
or SIP INFO) becomes `input_audio_buffer.dtmf`. The agent may call `end_call`, `transfer_call`
(a blind transfer: SIP REFER, only to `transfer_allow` targets) and `send_dtmf` (RFC 4733).
A call whose RTP stopped for `rtp_timeout_s` is ended; a caller who hangs up ends the session
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fnmatch
import gc
import json
import logging
import os
import re
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pjsua2 as pj
from rtmedia.clients.errors import RtmediaError
from rtmedia.clients.session import RealtimeSession
from rtmedia.clients.tools import declare
from rtmedia.protocol.events import client_event
from rtmedia.web.playout import FRAME_MS, ReplyPlayout
from rtmedia.web.telephony.echo import EchoCanceller
from rtmedia.web.telephony.sip_config import PJSIP_MAX_CALLS, SipConfig, Trunk, session_settings
from rtmedia.web.telephony.sip_metrics import SipMetrics, sample

log = logging.getLogger("rtmedia.sip")
TRANSPORT = "sip"
POLL_S = 0.005  # how often the loop handles PJSIP's SIP events and moves the calls' audio
ACK_EVERY_POLLS = 10
STATS_EVERY_S = 1.0
END_CALL_WAIT_S = 15.0
TRANSFER_WAIT_S = 30.0
MAX_TRANSCRIPTS = 50  # for the final status of the transferee's call to the target  # end_call lets the reply being spoken play out, for at most this long
INBOUND_FRAMES = 250  # frames (5 s) a call may queue toward a server that does not read
DTMF_DIGITS = re.compile(r"[0-9*#A-Da-d]{1,32}")
BUSY, UNAVAILABLE, FORBIDDEN, SERVER_ERROR = 486, 503, 403, 500


# ---- the tools the agent may call (declared from these signatures; run by SipCall.run_tool) ----------
def end_call(reason: str = "") -> None:
    """Hang up the phone call once what is being said has played (say goodbye first)."""


def transfer_call(target: str) -> None:
    """Transfer the caller to another phone number or SIP address (a blind transfer); the call ends here."""


def send_dtmf(digits: str) -> None:
    """Press keys on the phone line (0-9, * and #), e.g. to choose in a phone menu."""


# ---- frames across the media clock's thread -------------------------------------------------------
def _vector_reader() -> Callable[[Any], bytes]:
    """`bytes(frame.buf)` iterates a SWIG vector one element at a time (~130 µs a frame); a
    std::vector<unsigned char> is three pointers (begin, end, capacity) in libstdc++, so the
    frame is read in one copy instead, after checking that layout on a vector of known bytes."""
    probe = bytes(range(7, 250))
    vector = pj.ByteVector(probe)

    def fast(buf: Any) -> bytes:
        begin, end = (ctypes.c_size_t * 2).from_address(int(buf.this))
        return ctypes.string_at(begin, end - begin) if end > begin else b""

    try:
        if fast(vector) == probe:
            return fast
    except Exception:
        pass
    return bytes


read_vector = _vector_reader()


class CallPort(pj.AudioMediaPort):
    """A call's end of PJSIP's conference bridge: 20 ms PCM16 mono at `rate` both ways.

    Ports outlive their calls: the door keeps an ended call's port (`attach(None)`: silence out,
    nothing in) for the next call at its rate, and deletes ports only once the media clock has
    stopped. Deleting one while the clock runs lets the clock's thread call into a Python object
    being freed (its destructor releases the GIL to leave the bridge): the door crashed so."""

    def __init__(self, rate: int) -> None:
        super().__init__()
        self.rate = rate
        self.playout: ReplyPlayout | None = None
        self.echo: EchoCanceller | None = None
        self.frame_samples = rate * FRAME_MS // 1000
        self.silence = bytes(2 * self.frame_samples)
        self.inbound: deque[bytes] = deque(maxlen=INBOUND_FRAMES)
        fmt = pj.MediaFormatAudio()
        fmt.type, fmt.clockRate, fmt.channelCount = pj.PJMEDIA_TYPE_AUDIO, rate, 1
        fmt.bitsPerSample, fmt.frameTimeUsec = 16, FRAME_MS * 1000
        fmt.avgBps = fmt.maxBps = rate * 16
        self.createPort(f"rtmedia-{id(self):x}", fmt)

    def attach(self, playout: ReplyPlayout | None, echo: EchoCanceller | None = None) -> None:
        """Serve a call's playout (None: no call), cancelling its echo with `echo`."""
        self.inbound.clear()
        self.playout, self.echo = playout, echo

    def onFrameReceived(self, frame: pj.MediaFrame) -> None:  # the media clock's thread
        if self.playout is not None and frame.type == pj.PJMEDIA_FRAME_TYPE_AUDIO and frame.size:
            data = read_vector(frame.buf)
            echo = self.echo
            self.inbound.append(echo.heard(data) if echo is not None else data)

    def onFrameRequested(self, frame: pj.MediaFrame) -> None:  # the media clock's thread
        playout, echo = self.playout, self.echo
        data = playout.pull(self.frame_samples).tobytes() if playout is not None else self.silence
        if echo is not None:
            echo.played(data)
        frame.type = pj.PJMEDIA_FRAME_TYPE_AUDIO
        frame.buf = pj.ByteVector(data)
        frame.size = len(data)


def callback(method: Callable[..., None]) -> Callable[..., None]:
    """A PJSIP callback: an exception in it is logged (PJSIP would drop it silently)."""

    def run(self: Any, prm: Any) -> None:
        try:
            method(self, prm)
        except Exception:
            log.exception("sip callback %s failed", method.__name__)

    return run


# ---- one call -------------------------------------------------------------------------------------
@dataclass
class CallInfo:
    """What the door tells about a call (the calls API, logs, the session's instructions)."""

    id: str
    direction: str  # inbound | outbound
    caller: str  # the From URI's user part (the caller ID)
    called: str  # the To URI's user part (the number dialled: the DID)
    caller_uri: str = ""
    called_uri: str = ""
    sip_call_id: str = ""
    trunk: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    status: str = "new"  # ringing | dialing | answering | active | ended
    outcome: str = ""  # answered | busy | no_answer | rejected | failed | ... once ended
    end_reason: str = ""
    codec: str = ""
    echo_cancellation: bool = False
    session_id: str = ""
    dtmf: list[str] = field(default_factory=list)  # keys the session received
    transcript: list[str] = field(default_factory=list)  # the caller's last turns, as recognised
    underruns: int = 0  # gaps in replies at the door (web/playout.py), which the caller heard
    transfers: list[dict[str, Any]] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    answered_at: float | None = None
    ended_at: float | None = None

    def describe(self) -> dict[str, Any]:
        return dict(vars(self))


def uri_user(uri: str) -> str:
    """The user part of a SIP URI in a header value (`"Name" <sip:+1555@host>;tag=x` → +1555)."""
    match = re.search(r"sips?:([^@;>\s]+)@", uri) or re.search(r"(?:sips?|tel):([^;>\s]+)", uri)
    return match.group(1) if match else ""


def invite_headers(message: str, patterns: tuple[str, ...]) -> dict[str, str]:
    """The INVITE's headers whose names match `patterns` (shell wildcards, case-insensitive)."""
    out: dict[str, str] = {}
    for line in message.split("\r\n\r\n", 1)[0].split("\r\n")[1:]:
        name, sep, value = line.partition(":")
        if sep and any(fnmatch.fnmatch(name.strip().lower(), p.lower()) for p in patterns):
            out[name.strip()[:64]] = value.strip()[:256]
        if len(out) >= 16:
            break
    return out


def output_item(call_id: str, output: dict[str, Any]) -> Any:
    return client_event("conversation.item.create", item={"type": "function_call_output", "call_id": call_id,
                                                          "output": json.dumps(output)})


def fill(instructions: str, info: CallInfo) -> str:
    """`{caller}`, `{called}` and `{header:X-Name}` in a call's instructions, from its INVITE
    (an unknown header is empty; other braces stay as they are)."""
    headers = {k.lower(): v for k, v in info.headers.items()}

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name.startswith("header:"):
            return headers.get(name[7:].lower(), "")
        return {"caller": info.caller, "called": info.called}.get(name, match.group(0))

    return re.sub(r"\{(caller|called|header:[A-Za-z0-9-]+)\}", value, instructions)


class SipCall(pj.Call):
    """One SIP call and its Converse session."""

    def __init__(self, door: SipDoor, account: pj.Account, info: CallInfo, call_id: int = pj.PJSUA_INVALID_ID,
                 trunk: Trunk | None = None, session: dict[str, Any] | None = None) -> None:
        super().__init__(account, call_id)
        self.door, self.info, self.trunk = door, info, trunk
        self.settings = session or {}
        self.session: RealtimeSession | None = None
        self.playout: ReplyPlayout | None = None
        self.port: CallPort | None = None
        self.outgoing: asyncio.Queue[Any] = asyncio.Queue(INBOUND_FRAMES + 64)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.invite_at = time.perf_counter()
        self.rx_packets, self.rx_changed_at = -1, time.monotonic()
        self.rtp: tuple[int, int, float] | None = None  # the last RTP statistics (sip_metrics.sample)
        self.ended = asyncio.Event()
        self.tools_offered = False
        self.transfer: asyncio.Future[int] | None = None

    # ---- PJSIP callbacks (on the loop, inside libHandleEvents) ----
    @callback
    def onCallState(self, prm: pj.OnCallStateParam) -> None:
        ci = self.getInfo()
        if ci.state == pj.PJSIP_INV_STATE_CONFIRMED and self.info.direction == "outbound" \
                and self.info.status == "dialing":
            self.info.status = "answering"
            self.start(self.door.answered_outbound(self))
        elif ci.state == pj.PJSIP_INV_STATE_DISCONNECTED:
            self.door.disconnected(self, ci.lastStatusCode, ci.lastReason)

    @callback
    def onCallMediaState(self, prm: pj.OnCallMediaStateParam) -> None:
        if self.port is not None:
            return
        info = self.getInfo()  # (held: its media list lives in it)
        for media in info.media:
            if media.type == pj.PJMEDIA_TYPE_AUDIO and media.status == pj.PJSUA_CALL_MEDIA_ACTIVE:
                self.connect_media(media.index)
                return

    @callback
    def onDtmfDigit(self, prm: pj.OnDtmfDigitParam) -> None:
        digit = str(prm.digit)
        method = "info" if prm.method == pj.PJSUA_DTMF_METHOD_SIP_INFO else "rfc4733"
        log.info("sip dtmf", extra={"call": self.info.id, "digit": digit, "method": method})
        self.door.metrics.dtmf.labels(method).inc()
        self.send(client_event("input_audio_buffer.dtmf", event=digit))

    def onCallTransferRequest(self, prm: pj.OnCallTransferRequestParam) -> None:
        prm.statusCode = 603  # the far end may not move this call elsewhere (toll fraud); only the agent transfers

    @callback
    def onCallTransferStatus(self, prm: pj.OnCallTransferStatusParam) -> None:
        # 100 while the transferee tries the target (REFER accepted, NOTIFY of its progress), then the
        # final status of its call there.
        if self.transfer is not None and not self.transfer.done() and (prm.statusCode >= 200 or prm.finalNotify):
            self.transfer.set_result(prm.statusCode)
            prm.cont = False

    # ---- media ----
    def connect_media(self, index: int) -> None:
        stream = self.getStreamInfo(index)
        rate = int(stream.codecClockRate) or 8000
        self.info.codec = f"{stream.codecName}/{rate}"
        self.door.metrics.codecs.labels(stream.codecName).inc()
        settings = dict(self.settings)  # (checked by session_settings wherever they came from)
        self.info.echo_cancellation = settings.pop("echo_cancellation", self.door.config.echo_cancellation)
        self.playout = ReplyPlayout(rate)
        self.port = self.door.port_for(rate)
        self.port.attach(self.playout, EchoCanceller(rate) if self.info.echo_cancellation else None)
        audio = self.getAudioMedia(index)
        audio.startTransmit(self.port)
        self.port.startTransmit(audio)
        if isinstance(settings.get("instructions"), str):
            settings["instructions"] = fill(settings["instructions"], self.info)
        config = {**settings, "input_audio_format": {"encoding": "pcm16", "sample_rate": rate, "channels": 1},
                  "output_sample_rate": rate}
        self.send(client_event("session.update", event_id="sip-config", session=config))
        # The call-control tools on their own: a responder that cannot call tools refuses them
        # (invalid_value, tools), which would refuse the whole update with them.
        self.send(client_event("session.update", event_id="sip-tools",
                               session={"tools": {"functions": [declare(fn) for fn in self.door.tools()]}}))
        self.tools_offered = True
        log.info("sip media", extra={"call": self.info.id, "codec": self.info.codec})

    def pump(self, ack: bool) -> None:
        """(Each poll) the caller's frames to the session; the acks due."""
        port = self.port
        if port is None or self.session is None:
            return
        if port.inbound:
            frames = []
            while port.inbound:
                frames.append(port.inbound.popleft())
            self.send(client_event("input_audio_buffer.append", audio=b"".join(frames)))
        if ack and self.playout is not None:
            for rid, played in self.playout.acks()[0]:
                self.send(client_event("playback.ack", response_id=rid, played_ms=played))

    def check_rtp(self, now: float) -> None:
        """Ends the call when no RTP came for rtp_timeout_s; feeds the loss and jitter metrics."""
        if self.port is None or self.playout is None:
            return
        self.info.underruns = self.playout.buffer.stats.underruns
        try:
            rx = self.getStreamStat(0).rtcp.rxStat
        except pj.Error:
            return
        self.rtp = sample(rx)
        if rx.pkt != self.rx_packets:
            self.rx_packets, self.rx_changed_at = rx.pkt, now
        elif now - self.rx_changed_at > self.door.config.rtp_timeout_s:
            self.hang_up(f"no RTP for {self.door.config.rtp_timeout_s:g} s", 408)

    # ---- the session ----
    def send(self, request: Any) -> None:
        try:
            self.outgoing.put_nowait(request)
        except asyncio.QueueFull:
            self.door.metrics.dropped_frames.inc()

    def start(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def open_session(self) -> None:
        """Open the call's Converse session (before the call is answered: a refusal is a 503)."""
        metadata = (*self.door.metadata, ("rtmedia-transport", TRANSPORT))
        self.session = RealtimeSession(channel=self.door.channel, metadata=metadata)
        created = await asyncio.wait_for(self.session.open(), 10.0)
        self.info.session_id = created.session_id
        self.start(self.write_loop())
        self.start(self.read_loop())

    async def write_loop(self) -> None:
        assert self.session is not None
        while (request := await self.outgoing.get()) is not None:
            try:
                await self.session.send(request)
            except RtmediaError:
                return

    async def read_loop(self) -> None:
        assert self.session is not None
        try:
            while (event := await self.session.next_event()) is not None:
                msg = event.proto
                if self.playout is not None:
                    self.playout.on_event(msg)
                kind = msg.WhichOneof("event")
                if kind == "response_done" and msg.response_done.function_calls:
                    self.start(self.run_tools(list(msg.response_done.function_calls)))
                elif kind == "conversation_item_input_audio_transcription_completed":
                    self.info.transcript = [*self.info.transcript[-(MAX_TRANSCRIPTS - 1):],
                                            msg.conversation_item_input_audio_transcription_completed.transcript]
                elif kind == "input_audio_buffer_dtmf_event_received":
                    self.info.dtmf.append(msg.input_audio_buffer_dtmf_event_received.event)
                elif kind == "session_closed":
                    self.hang_up(f"session closed: {msg.session_closed.reason}")
                    return
                elif kind == "error" and not (self.tools_offered and msg.error.param == "tools"):
                    log.warning("sip call: session error", extra={"call": self.info.id, "code": msg.error.code,
                                                                  "error_message": msg.error.message[:200]})
        except RtmediaError as exc:
            if exc.code != grpc.StatusCode.CANCELLED:
                log.warning("sip call: session failed", extra={"call": self.info.id, "details": exc.details})
        self.hang_up("the session ended")

    async def run_tools(self, calls: list[Any]) -> None:
        """A response's calls, in order; their outputs, then a response that uses them (none
        after end_call, whose output goes first: the server's filler must not start)."""
        answered = 0
        for call in calls:
            try:
                arguments = json.loads(call.arguments or "{}")
                if not isinstance(arguments, dict):
                    raise ValueError("the arguments are not a JSON object")
                if call.name == "end_call":
                    self.send(output_item(call.call_id, {"ending": True}))
                output = await self.run_tool(call.name, arguments)
            except (ValueError, TypeError) as exc:
                output = {"error": str(exc)}
            log.info("sip tool", extra={"call": self.info.id, "tool": call.name, "output": json.dumps(output)[:200]})
            if output is None:  # the call is ending: nothing to answer
                return
            self.send(output_item(call.call_id, output))
            answered += 1
        if answered:
            self.send(client_event("response.create"))

    async def run_tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any] | None:
        """A tool's output; None once the call ends."""
        if name == "end_call":
            await self.played_out()
            self.hang_up(f"end_call: {str(arguments.get('reason', ''))[:100]}".rstrip(": "))
            return None
        if name == "send_dtmf":
            digits = str(arguments.get("digits", ""))
            if not DTMF_DIGITS.fullmatch(digits):
                return {"error": "digits must be 1 to 32 of 0-9, *, # and A-D"}
            await self.played_out()
            self.dialDtmf(digits)
            return {"sent": digits}
        if name == "transfer_call":
            return await self.transfer_to(str(arguments.get("target", "")))
        return {"error": f"no tool {name!r}"}

    async def played_out(self) -> None:
        """Until the reply being spoken has played (at most END_CALL_WAIT_S)."""
        deadline = time.monotonic() + END_CALL_WAIT_S
        for _ in range(int(END_CALL_WAIT_S / 0.05)):  # (the media clock's thread drains it: polled)
            if self.playout is None or not self.playout.playing() or self.ended.is_set() \
                    or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.05)

    async def transfer_to(self, target: str) -> dict[str, Any] | None:
        uri = self.door.transfer_uri(target, self.trunk)
        if uri is None:
            return {"error": f"transfers to {target!r} are not allowed"}
        await self.played_out()
        self.transfer = asyncio.get_running_loop().create_future()
        try:
            self.xfer(uri, pj.CallOpParam(True))
            status = await asyncio.wait_for(self.transfer, TRANSFER_WAIT_S)
        except pj.Error as exc:
            status = exc.status
        except TimeoutError:
            status = 408
        self.info.transfers.append({"target": uri, "status": status})
        self.door.metrics.transfers.labels("ok" if 200 <= status < 300 else "failed").inc()
        if 200 <= status < 300:
            self.hang_up(f"transferred to {uri}")
            return None
        return {"error": f"the transfer to {uri} failed with SIP status {status}"}

    # ---- ending ----
    def hang_up(self, reason: str, status: int = 200) -> None:
        """End the call (a final `status` to an unanswered one); idempotent."""
        if self.info.status == "ended" or self.info.end_reason:
            return
        self.info.end_reason = reason
        log.info("sip call ending", extra={"call": self.info.id, "reason": reason})
        op = pj.CallOpParam(True)
        op.statusCode = status if status >= 300 else 0  # (an answered call gets a BYE whatever the status)
        with contextlib.suppress(pj.Error):
            self.hangup(op)

    async def close(self) -> None:
        """After PJSIP disconnected the call: end its session and tasks."""
        with contextlib.suppress(asyncio.QueueFull):
            self.outgoing.put_nowait(None)
        if self.session is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.session.event("session.close", reason="client"), 1.0)
            self.session.cancel_stream()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.ended.set()



# ---- the door -------------------------------------------------------------------------------------
class Account(pj.Account):
    def __init__(self, door: SipDoor, trunk: Trunk | None) -> None:
        super().__init__()
        self.door, self.trunk = door, trunk

    @callback
    def onIncomingCall(self, prm: pj.OnIncomingCallParam) -> None:
        self.door.incoming(self, prm)

    @callback
    def onRegState(self, prm: pj.OnRegStateParam) -> None:
        assert self.trunk is not None
        ok = 200 <= prm.code < 300
        self.door.metrics.registered.labels(self.trunk.name).set(1 if ok and prm.expiration > 0 else 0)
        if not ok:
            self.door.metrics.registration_failures.labels(self.trunk.name).inc()
            log.warning("sip registration failed", extra={"trunk": self.trunk.name, "code": prm.code,
                                                          "reason": prm.reason})
        else:
            log.info("sip registered", extra={"trunk": self.trunk.name, "expires_s": prm.expiration})


@contextlib.contextmanager
def quiet_stdio() -> Any:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


class LogWriter(pj.LogWriter):
    def write(self, entry: pj.LogEntry) -> None:  # any thread
        log.debug("pjsip: %s", entry.msg.rstrip())


class SipDoor:
    """PJSIP's endpoint, its transports and accounts, and the calls."""

    def __init__(self, config: SipConfig, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = (),
                 metrics: SipMetrics | None = None) -> None:
        self.config, self.channel, self.metadata = config, channel, metadata
        self.metrics = metrics or SipMetrics()
        self.calls: dict[str, SipCall] = {}  # by CallInfo.id, until disconnected
        self.history: deque[CallInfo] = deque(maxlen=200)  # ended calls, newest last
        self.draining = False
        self.no_calls = asyncio.Event()
        self.no_calls.set()
        self.ep: pj.Endpoint | None = None
        self.accounts: list[Account] = []
        self.spare_ports: dict[int, list[CallPort]] = {}  # by rate: ports of ended calls (CallPort)
        self.ports: dict[str, int] = {}  # transport -> the bound port
        self._poller: asyncio.Task[None] | None = None
        self._log_writer = LogWriter()

    # ---- life cycle ----
    def start(self) -> None:
        config = self.config
        ep = self.ep = pj.Endpoint()
        with quiet_stdio():  # (PJSIP's banner, written before its log settings apply)
            ep.libCreate()
        cfg = pj.EpConfig()
        cfg.uaConfig.threadCnt, cfg.uaConfig.mainThreadOnly = 0, True
        cfg.uaConfig.maxCalls = PJSIP_MAX_CALLS  # (over it, pjsua answers 486 itself)
        cfg.uaConfig.userAgent = "rtmedia"
        med = cfg.medConfig
        # The conference bridge runs at 16 kHz where G.722 may be negotiated, else at G.711's 8 kHz:
        # each call's audio is then resampled by neither the bridge nor its port.
        med.clockRate = med.sndClockRate = 16000 if "G722" in config.codecs else 8000
        med.audioFramePtime = med.ptime = FRAME_MS
        med.noVad, med.ecTailLen = True, 0
        med.maxMediaPorts = 4 * PJSIP_MAX_CALLS + 4
        cfg.logConfig.level = cfg.logConfig.consoleLevel = config.log_level
        cfg.logConfig.writer = self._log_writer
        cfg.logConfig.decor = 0
        ep.libInit(cfg)
        host, port = config.listen
        for kind, name in ((pj.PJSIP_TRANSPORT_UDP, "udp"), (pj.PJSIP_TRANSPORT_TCP, "tcp")):
            # (UDP first: with port 0 it picks the port, and TCP takes the same one)
            port = self.ports[name] = self._transport(kind, self._transport_config(host, port))
        if config.tls_listen is not None:
            tcfg = self._transport_config(*config.tls_listen)
            tcfg.tlsConfig.certFile, tcfg.tlsConfig.privKeyFile = config.tls_cert, config.tls_key
            self.ports["tls"] = self._transport(pj.PJSIP_TRANSPORT_TLS, tcfg)
        ep.libStart()
        ep.audDevManager().setNullDev()
        for codec in ep.codecEnum2():
            name = codec.codecId.split("/")[0].upper()
            ep.codecSetPriority(codec.codecId, 200 - config.codecs.index(name) if name in config.codecs else 0)
        local = Account(self, None)
        acfg = self._account_config()
        advertised = config.public_address or host
        acfg.idUri = f"sip:rtmedia@{advertised}:{self.ports['udp']}"
        local.create(acfg, True)
        self.accounts.append(local)
        for trunk in config.trunks:
            acc = Account(self, trunk)
            acfg = self._account_config()
            acfg.idUri, acfg.regConfig.registrarUri = trunk.register, trunk.registrar
            acfg.regConfig.timeoutSec, acfg.regConfig.retryIntervalSec = trunk.expires_s, 30
            if trunk.password is not None:
                acfg.sipConfig.authCreds.append(pj.AuthCredInfo("digest", "*", trunk.username, 0, trunk.password))
            acc.create(acfg)
            self.accounts.append(acc)
        self._poller = asyncio.get_running_loop().create_task(self.poll(), name="sip-poll")
        log.info("sip listening", extra={"host": host, **self.ports, "public_address": advertised,
                                         "rtp_ports": f"{config.rtp_ports[0]}-{config.rtp_ports[1]}"})

    def _transport(self, kind: int, tcfg: pj.TransportConfig) -> int:
        """Creates a transport; its bound port."""
        assert self.ep is not None
        try:
            tid = self.ep.transportCreate(kind, tcfg)
        except pj.Error as exc:
            where = f"{tcfg.boundAddress or '0.0.0.0'}:{tcfg.port}"
            raise OSError(f"cannot listen for SIP on {where}: {exc.reason}") from None
        return int(self.ep.transportGetInfo(tid).localName.rsplit(":", 1)[1])

    def _transport_config(self, host: str, port: int) -> pj.TransportConfig:
        tcfg = pj.TransportConfig()
        tcfg.port = port
        if host not in ("0.0.0.0", "::"):
            tcfg.boundAddress = host
        if self.config.public_address:
            tcfg.publicAddress = self.config.public_address
        return tcfg

    def _account_config(self) -> pj.AccountConfig:
        acfg = pj.AccountConfig()
        lo, hi = self.config.rtp_ports
        media = acfg.mediaConfig.transportConfig
        media.port, media.portRange = lo, hi - lo
        host = self.config.listen[0]
        if host not in ("0.0.0.0", "::"):
            media.boundAddress = host
        media.publicAddress = self.config.public_address or host
        acfg.mediaConfig.srtpUse = {"off": pj.PJMEDIA_SRTP_DISABLED, "optional": pj.PJMEDIA_SRTP_OPTIONAL,
                                    "mandatory": pj.PJMEDIA_SRTP_MANDATORY}[self.config.srtp]
        acfg.mediaConfig.srtpSecureSignaling = 0
        acfg.natConfig.sdpNatRewriteUse = 0
        acfg.natConfig.contactRewriteUse = 0 if self.config.public_address else 1
        return acfg

    async def poll(self) -> None:
        """PJSIP's SIP events, the calls' audio and acks, and their RTP checks, on the loop."""
        tick = 0
        stats_at = time.monotonic()
        while True:
            tick += 1
            now = time.monotonic()
            stats = now - stats_at >= STATS_EVERY_S
            if stats:
                stats_at = now
            self._tick(tick % ACK_EVERY_POLLS == 0, now if stats else None)
            await asyncio.sleep(POLL_S)

    def _tick(self, ack: bool, stats_at: float | None) -> None:
        """(Not inlined in poll: this frame's references to calls go with it.)"""
        assert self.ep is not None
        self.ep.libHandleEvents(0)
        for call in list(self.calls.values()):
            call.pump(ack)
            if stats_at is not None:
                call.check_rtp(stats_at)

    async def drain(self, grace_s: float) -> None:
        """New calls get 503; live calls go on for at most `grace_s`, then are hung up."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.no_calls.wait(), grace_s)
        for call in list(self.calls.values()):
            call.hang_up("the server is shutting down")

    async def stop(self) -> None:
        for call in list(self.calls.values()):
            call.hang_up("the SIP door is stopping")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.no_calls.wait(), 3)
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        for call in list(self.calls.values()):
            await call.close()
            self.retire(call)
        self.calls.clear()
        # Every Call object must go while PJSIP lives: its destructor calls into PJSIP (and
        # asserts after libDestroy). Ended calls wait in reference cycles for the collector.
        gc.collect()
        if self.ep is not None:
            self.ep.audDevManager().setNoDev()  # the media clock stops: now ports may go
            self.spare_ports.clear()
            gc.collect()
            for acc in self.accounts:
                with contextlib.suppress(pj.Error):
                    acc.shutdown()
            self.accounts.clear()
            self.ep.libDestroy()
            self.ep = None

    # ---- inbound calls ----
    def incoming(self, account: Account, prm: pj.OnIncomingCallParam) -> None:
        trunk = account.trunk
        info = CallInfo(uuid.uuid4().hex[:16], "inbound", "", "", trunk=trunk.name if trunk else "",
                        headers=invite_headers(prm.rdata.wholeMsg, self.config.headers))
        call = SipCall(self, account, info, prm.callId, trunk)
        ci = call.getInfo()
        info.caller, info.called = uri_user(ci.remoteUri), uri_user(ci.localUri)
        info.caller_uri, info.called_uri, info.sip_call_id = ci.remoteUri[:256], ci.localUri[:256], ci.callIdString[:128]
        call.settings = self.config.for_call(info.called, trunk)
        self.add(call)
        refusal = self._refusal(trunk)
        if refusal is not None:
            status, why = refusal
            self.reject(call, status, why)
            return
        info.status = "ringing"
        self.metrics.active.inc()
        op = pj.CallOpParam(True)
        op.statusCode = 180
        call.answer(op)
        call.start(self.accept(call))

    def add(self, call: SipCall) -> None:
        self.calls[call.info.id] = call
        self.no_calls.clear()

    def port_for(self, rate: int) -> CallPort:
        """A spare port at `rate`, else a new one (see CallPort: ports are kept, not deleted)."""
        spares = self.spare_ports.setdefault(rate, [])
        return spares.pop() if spares else CallPort(rate)

    def retire(self, call: SipCall) -> None:
        """An ended call's port goes back to the spares, detached (PJSIP dropped its connections
        with the call's stream)."""
        if call.port is not None:
            call.port.attach(None)
            self.spare_ports.setdefault(call.port.rate, []).append(call.port)
            call.port = None

    def remove(self, call: SipCall) -> None:
        self.calls.pop(call.info.id, None)
        if not self.calls:
            self.no_calls.set()

    def _refusal(self, trunk: Trunk | None) -> tuple[int, str] | None:
        if self.draining:
            return UNAVAILABLE, "draining"
        live = [c for c in self.calls.values() if c.info.status in ("ringing", "active", "dialing", "answering")]
        if len(live) >= self.config.max_calls:
            return BUSY, "max_calls"
        if trunk is not None and trunk.max_calls is not None \
                and sum(c.trunk is trunk for c in live) >= trunk.max_calls:
            return BUSY, f"trunk {trunk.name} max_calls"
        return None

    def reject(self, call: SipCall, status: int, why: str) -> None:
        call.info.outcome, call.info.end_reason = "rejected", why
        self.metrics.calls.labels(call.info.direction, "rejected").inc()
        log.info("sip call refused", extra={"call": call.info.id, "status": status, "why": why,
                                            "caller": call.info.caller, "called": call.info.called})
        op = pj.CallOpParam(True)
        op.statusCode = status
        with contextlib.suppress(pj.Error):
            call.answer(op)

    async def accept(self, call: SipCall) -> None:
        """Decide (the rules, then the hook), open the session, answer 200."""
        info = call.info
        decision = await self.decide(info)
        if decision is not None:
            status, why = decision
            self._unring(call)
            self.reject(call, status, why)
            return
        try:
            await call.open_session()
            if info.status == "ended":  # the caller gave up while the session opened
                await call.close()
                return
        except (RtmediaError, TimeoutError) as exc:
            busy = isinstance(exc, RtmediaError) and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            if not busy:
                log.warning("sip call: the server refused the session",
                            extra={"call": info.id, "error": getattr(exc, "details", str(exc))})
            self._unring(call)
            self.reject(call, UNAVAILABLE, "the server refused the session")
            return
        op = pj.CallOpParam(True)
        op.statusCode = 200
        try:
            call.answer(op)
        except pj.Error as exc:
            log.warning("sip answer failed", extra={"call": info.id, "error": exc.info()})
            return
        info.status, info.answered_at = "active", time.time()
        self.metrics.setup.observe(time.perf_counter() - call.invite_at)
        self.metrics.calls.labels("inbound", "answered").inc()
        log.info("sip call", extra={"call": info.id, "caller": info.caller, "called": info.called,
                                    "trunk": info.trunk, "session_id": info.session_id})

    def _unring(self, call: SipCall) -> None:
        if call.info.status == "ringing":
            self.metrics.active.dec()
            call.info.status = "new"

    async def decide(self, info: CallInfo) -> tuple[int, str] | None:
        """None to answer; else the status to refuse with, and why."""
        rules = self.config.accept
        if not rules.decide(info.caller, info.caller_uri):
            return FORBIDDEN, "the accept rules"
        if rules.webhook is None:
            return None
        body = {k: getattr(info, k) for k in ("id", "caller", "called", "caller_uri", "called_uri", "sip_call_id",
                                              "trunk", "headers")}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=rules.webhook_timeout_s)) as http, \
                    http.post(rules.webhook, json=body) as res:
                answer = await res.json(content_type=None) if res.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("sip accept hook failed: the call is refused", extra={"call": info.id, "error": str(exc)})
            return UNAVAILABLE, "the accept hook did not answer"
        if not isinstance(answer, dict) or not isinstance(answer.get("accept"), bool):
            return UNAVAILABLE, "the accept hook's answer is not {\"accept\": true|false}"
        if not answer["accept"]:
            status = answer.get("status")
            return (status if isinstance(status, int) and 400 <= status < 700 else FORBIDDEN), "the accept hook"
        if answer.get("session") is not None:
            try:
                session = session_settings(answer["session"], "the accept hook's session")
            except ValueError as exc:
                log.warning("sip accept hook: bad session settings: the call is refused",
                            extra={"call": info.id, "error": str(exc)})
                return UNAVAILABLE, str(exc)
            call = self.calls.get(info.id)
            if call is not None:
                call.settings = {**call.settings, **session}
        return None

    # ---- outbound calls ----
    def dial(self, to: str, trunk_name: str | None = None, session: dict[str, Any] | None = None,
             ring_timeout_s: float | None = None) -> CallInfo:
        """Starts an outbound call (ValueError: a bad request; LookupError: no such trunk;
        RuntimeError: no capacity)."""
        session = session_settings(session, "session")
        trunk = next((t for t in self.config.trunks if t.name == trunk_name), None)
        if trunk_name and trunk is None:
            raise LookupError(f"no trunk {trunk_name!r}")
        uri = self.target_uri(to, trunk)
        if uri is None:
            raise ValueError(f"`to` must be a SIP URI, or a number with a trunk to dial it through; got {to!r}")
        refusal = self._refusal(trunk)
        if refusal is not None:
            raise RuntimeError(refusal[1])
        account = self.accounts[self.config.trunks.index(trunk) + 1] if trunk else self.accounts[0]
        info = CallInfo(uuid.uuid4().hex[:16], "outbound", "", uri_user(uri) or to, "", uri,
                        trunk=trunk.name if trunk else "", status="dialing")
        settings = {**self.config.for_call(info.called, trunk), **session}
        call = SipCall(self, account, info, trunk=trunk, session=settings)
        self.add(call)
        self.metrics.active.inc()
        try:
            call.makeCall(uri, pj.CallOpParam(True))
        except pj.Error as exc:
            self.remove(call)
            self.metrics.active.dec()
            raise ValueError(f"cannot dial {uri}: {exc.reason or exc.info()}") from None
        call.start(self.ring_deadline(call, ring_timeout_s or self.config.ring_timeout_s))
        log.info("sip dialing", extra={"call": info.id, "to": uri, "trunk": info.trunk})
        return info

    async def ring_deadline(self, call: SipCall, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        if call.info.status == "dialing":
            call.info.outcome = "no_answer"
            call.hang_up(f"no answer within {timeout_s:g} s")

    async def answered_outbound(self, call: SipCall) -> None:
        try:
            await call.open_session()
        except (RtmediaError, TimeoutError) as exc:
            call.info.outcome = "failed"
            call.hang_up(f"the server refused the session: {getattr(exc, 'details', exc)}")
            return
        call.info.status, call.info.answered_at = "active", time.time()
        call.info.outcome = "answered"
        self.metrics.setup.observe(time.perf_counter() - call.invite_at)
        self.metrics.calls.labels("outbound", "answered").inc()

    def target_uri(self, to: str, trunk: Trunk | None) -> str | None:
        """A SIP URI as it is; a number (digits, + and *#) through `trunk`'s host."""
        if re.fullmatch(r"sips?:[^\s<>\"]+", to):
            return to
        if trunk is not None and re.fullmatch(r"\+?[0-9*#]{1,32}", to):
            return f"sip:{to}@{trunk.registrar.split(':', 1)[1]}"
        return None

    def transfer_uri(self, target: str, trunk: Trunk | None) -> str | None:
        uri = self.target_uri(target, trunk)
        if uri is None or not (self.config.may_transfer_to(target) or self.config.may_transfer_to(uri)):
            return None
        return uri

    def tools(self) -> list[Callable[..., Any]]:
        return [end_call, send_dtmf, *([transfer_call] if self.config.transfer_allow else [])]

    # ---- the end of a call ----
    def disconnected(self, call: SipCall, status: int, reason: str) -> None:
        info = call.info
        was = info.status
        if was in ("ringing", "active", "dialing", "answering"):
            self.metrics.active.dec()
        if not info.outcome:
            info.outcome = ("busy" if status in (486, 600) else "no_answer" if status in (408, 480, 487)
                            else "failed") if was == "dialing" else "cancelled" if was == "ringing" else "ended"
        if was == "dialing":
            self.metrics.calls.labels("outbound", info.outcome).inc()
        if not info.end_reason:
            info.end_reason = f"hung up by the other side ({status} {reason})" if was == "active" else \
                f"{status} {reason}"
        info.status, info.ended_at = "ended", time.time()
        self.metrics.observe_rtp(call.rtp)
        if call.playout is not None:
            info.underruns = call.playout.buffer.stats.underruns
            self.metrics.underruns.inc(info.underruns)
        log.info("sip call ended", extra={"call": info.id, "outcome": info.outcome, "reason": info.end_reason,
                                          "seconds": round(info.ended_at - info.created_at, 1)})
        asyncio.get_running_loop().create_task(self._forget(call))

    async def _forget(self, call: SipCall) -> None:
        await call.close()
        self.retire(call)
        self.remove(call)
        self.history.append(call.info)

    def find(self, call_id: str) -> CallInfo | None:
        call = self.calls.get(call_id)
        return call.info if call is not None else next((i for i in self.history if i.id == call_id), None)
