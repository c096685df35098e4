"""One call of the SIP door (rtmedia.web.telephony.sip): `SipCall`, PJSIP's call with its
Converse session; the `CallPort` that moves its frames across PJSIP's media clock; its
`CallInfo`, for the logs and the calls API; and the tools the agent may call on a phone line
(`end_call`, `transfer_call`, `send_dtmf`).

A module of its own so that the door (the endpoint, its transports and accounts, admission and
draining) and a call's life (its session, audio, DTMF, transfer and hang-up) each read whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fnmatch
import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pjsua2 as pj
from rtmedia.clients.tools import declare
from rtmedia.protocol.events import client_event
from rtmedia.v1 import realtime_pb2
from rtmedia.web.door import OPEN_TIMEOUT_S, STOP, Door, Fault, on
from rtmedia.web.playout import FRAME_MS, ReplyPlayout
from rtmedia.web.telephony.echo import EchoCanceller
from rtmedia.web.telephony.sip_config import Trunk
from rtmedia.web.telephony.sip_metrics import sample

if TYPE_CHECKING:
    from rtmedia.web.telephony.sip import SipDoor

log = logging.getLogger("rtmedia.sip")
TRANSPORT = "sip"
END_CALL_WAIT_S = 15.0
TRANSFER_WAIT_S = 30.0
MAX_TRANSCRIPTS = 50  # for the final status of the transferee's call to the target  # end_call lets the reply being spoken play out, for at most this long
INBOUND_FRAMES = 250  # frames (5 s) a call may queue toward a server that does not read
DTMF_DIGITS = re.compile(r"[0-9*#A-Da-d]{1,32}")


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


class SipCall(pj.Call, Door):
    """One SIP call and its Converse session: the caller's frames, DTMF, acks and the tools'
    outputs are queued for the session (`send`), its events answered by the `@on` handlers."""

    transport = TRANSPORT
    open_timeout_s = OPEN_TIMEOUT_S
    input_queue = INBOUND_FRAMES + 64

    def __init__(self, door: SipDoor, account: pj.Account, info: CallInfo, call_id: int = pj.PJSUA_INVALID_ID,
                 trunk: Trunk | None = None, session: dict[str, Any] | None = None) -> None:
        pj.Call.__init__(self, account, call_id)
        Door.__init__(self)
        self.door, self.info, self.trunk = door, info, trunk
        self.settings = session or {}
        self.playout: ReplyPlayout | None = None
        self.port: CallPort | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.reader: asyncio.Task[Any] | None = None  # the output pump
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
        if not self.put(request):
            self.door.metrics.dropped_frames.inc()

    def start(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def open_session(self) -> None:
        """Open the call's Converse session (before the call is answered: a refusal is a 503)."""
        created = await self.open_converse(self.door.channel, self.door.metadata)
        self.info.session_id = created.session_id
        self.start(self.pump_input())
        self.reader = self.start(self.pump_output())

    async def dispatch(self, msg: realtime_pb2.ConverseResponse) -> bool | None:
        if self.playout is not None:
            self.playout.on_event(msg)
        return await super().dispatch(msg)

    @on("response.done")
    def _done(self, msg: realtime_pb2.ConverseResponse) -> None:
        if msg.response_done.function_calls:
            self.start(self.run_tools(list(msg.response_done.function_calls)))

    @on("conversation.item.input_audio_transcription.completed")
    def _transcript(self, msg: realtime_pb2.ConverseResponse) -> None:
        self.info.transcript = [*self.info.transcript[-(MAX_TRANSCRIPTS - 1):],
                                msg.conversation_item_input_audio_transcription_completed.transcript]

    @on("input_audio_buffer.dtmf_event_received")
    def _dtmf(self, msg: realtime_pb2.ConverseResponse) -> None:
        self.info.dtmf.append(msg.input_audio_buffer_dtmf_event_received.event)

    @on("session.closed")
    def _closed(self, msg: realtime_pb2.ConverseResponse) -> bool:
        self.hang_up(f"session closed: {msg.session_closed.reason}")
        return STOP

    @on("error")
    def _error(self, msg: realtime_pb2.ConverseResponse) -> None:
        if not (self.tools_offered and msg.error.param == "tools"):
            log.warning("sip call: session error", extra={"call": self.info.id, "code": msg.error.code,
                                                          "error_message": msg.error.message[:200]})

    async def on_fault(self, fault: Fault) -> None:
        if not fault.quiet:
            log.warning("sip call: session failed", extra={"call": self.info.id, "details": fault.details})
        self.hang_up("the session ended")

    async def on_stream_end(self) -> None:
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
        self.put(None)  # the queued frames go, then the input pump ends
        if self.session is not None:
            await self.end_session(self.reader)  # the doors' one close rule
            self.session.cancel_stream()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.ended.set()
