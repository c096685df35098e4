"""The server's doors, for fuzzing: one registry (`DOORS`) of what can be sent through each
door (a Hypothesis strategy of cases) and how one case is sent and judged (an async runner),
shared by the quick tests (tests/reliability/test_fuzz.py) and the long run
(tests/reliability/fuzz.py).

A door is registered with `@door(name, cases, needs=...)` on its runner; `needs` names what
the server must offer for it ("riva", "web", "auth", "openai", "twilio", "sip"). A new door (a service, a method, an HTTP
route) is one strategy and one runner here, and both the quick tests and the long run pick it
up. Request messages come from `strategies.message`, which fuzzes every field of a request
type, so a field added to a request later is covered without a change here.

What every case must end with (`run_case` checks it all):
- a clear answer: a gRPC status other than UNKNOWN or INTERNAL, with an ErrorInfo reason
  whenever rtmedia (not grpc's core: message size, unknown method) ends the call; or `error`
  events on a stream that stays open, each with a code and a message, never `server_error`;
  over HTTP a status below 500 (or 502/503) and, for an error, the bridge's JSON shape; on a
  WebSocket (/v1/realtime) the upgrade or OpenAI's error below 500, then server events that are
  JSON with a type and a unique event_id, and `error` events in OpenAI's nested shape, never
  `server_error`, on a socket that stays open (only a frame over its limit closes it, 1009);
- an end: a stream ends within a bounded time once the client closes it (a response still
  playing out is the only thing that may hold a half-closed Converse stream open), and a
  socket answers the client's close;
- nothing left behind: the server's sessions and the bridge's peers back to their baseline;
- the server still there: alive and answering health, with no error logged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import math
import re
import time
import wave
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any
from urllib.parse import quote

import grpc
import numpy as np
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import strategies as st
from riva.client.proto import riva_asr_pb2, riva_audio_pb2, riva_tts_pb2
from rtmedia.protocol.errors import error_reason
from rtmedia.protocol.events import client_event
from rtmedia.v1 import realtime_pb2, speech_pb2, video_pb2

from tests.reliability.strategies import (
    RATES,
    UNSET,
    SdpEdit,
    apply_edits,
    audio,
    blobs,
    floats,
    header_values,
    integers,
    json_values,
    long_text,
    message,
    path_segments,
    sdp_edits,
    sometimes,
    speech_pcm,
    strings,
    weighted,
)

# How long a call may take to end once the client has sent everything (or closed), in seconds.
END_S = 15.0
# A Converse case's stream, once the client closed it, ends within this (a reply may still be
# speaking after a half-close: then the case closes the session, which must end it at once).
CLOSE_S = 5.0
SETTLE_S = 5.0  # sessions and peers go back to their baseline within this after a case
# Statuses grpc's core gives without rtmedia's handler (no ErrorInfo), recognised by their details.
CORE_DETAILS = ("Received message larger than max", "Sent message larger than max", "Method not found",
                "Unimplemented", "Unexpected error in RPC handling")
RESPONSE_OPEN_MARKER = "\x00last-response"
ITEM_MARKER = "\x00last-item"
CHANNELS_MARKER = -7  # a latent's channel count: the VAE's, resolved by the runner


# ---- what a case sees --------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What one case got back. `statuses` counts each call's ending (`CODE` or `CODE/REASON`,
    `HTTP n` or `HTTP n/reason`); `problems` says what in it breaks the rules above."""

    statuses: Counter[str] = field(default_factory=Counter)
    error_events: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    calls: int = 0

    def status(self, code: str, reason: str = "") -> None:
        self.calls += 1
        self.statuses[f"{code}/{reason}" if reason else code] += 1

    def grpc_status(self, code: grpc.StatusCode, reason: str, details: str, cancelled: bool = False,
                    where: str = "") -> None:
        """Count one call's status and judge it (`cancelled`: the client cancelled it on purpose)."""
        self.status(code.name, reason)
        prefix = f"{where}: " if where else ""
        if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            self.problems.append(f"{prefix}{code.name}: {details[:300]}")
        elif code == grpc.StatusCode.CANCELLED and not cancelled:
            self.problems.append(f"{prefix}CANCELLED, and the client did not cancel: {details[:300]}")
        elif code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED) and not reason and \
                not any(core in details for core in CORE_DETAILS):
            self.problems.append(f"{prefix}{code.name} without an ErrorInfo reason: {details[:300]}")


def _cancelling() -> bool:
    """Whether this task itself is being cancelled (not only a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _rpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    if not isinstance(exc, grpc.aio.AioRpcError):
        raise exc
    try:
        reason = error_reason(exc) or ""
    except ValueError as bad:  # status details that contradict the status code
        return exc.code(), "", f"{exc.details()} (and its details do not parse: {bad})"
    return exc.code(), reason, exc.details() or ""


def lost_by_client(exc: grpc.aio.AioRpcError) -> bool:
    """grpc's asyncio client replaced the server's status with its own INTERNAL: a request it was
    still writing when the server ended the call failed, and it overwrote the status the server
    had sent (grpc/grpc#36066; grpc's sync client and other implementations report the server's).
    Streams here send at a pace that makes this rare (`paced`); the rest are counted apart."""
    return exc.code() == grpc.StatusCode.INTERNAL and exc.details() == "Internal error from Core" and \
        "SendMessageOperation" in (exc.debug_error_string() or "")


LOST = "LOST_BY_CLIENT"
PACE_S = 0.001  # between two requests of a stream (see lost_by_client)


def paced(factory: Callable[..., Any], requests: Iterable[Any], **kwargs: Any) -> Any:
    """`factory(requests)` for a client-streaming call, its requests sent one at a time, and no
    more once the call has ended (see lost_by_client)."""
    holder: dict[str, Any] = {}

    async def send() -> AsyncIterator[Any]:
        for request in requests:
            call = holder.get("call")
            if call is not None and call.done():
                return
            yield request
            await asyncio.sleep(PACE_S)

    call = holder["call"] = factory(send(), **kwargs)
    return call


async def finish(call: Any, outcome: Outcome, cancelled: bool = False, where: str = "") -> list[Any]:
    """Read a call to its end within END_S: its responses; its status goes to `outcome`."""
    return (await ended(call, outcome, cancelled, where))[0]


async def ended(call: Any, outcome: Outcome, cancelled: bool = False, where: str = "") -> tuple[list[Any], str]:
    """`finish`, and the call's ending as counted in `outcome.statuses`."""
    responses: list[Any] = []

    async def read() -> None:
        if hasattr(call, "__aiter__"):
            async for response in call:
                responses.append(response)
        else:
            responses.append(await call)

    try:
        await asyncio.wait_for(read(), END_S)
        code, reason, details = grpc.StatusCode.OK, "", ""
    except TimeoutError:
        call.cancel()
        outcome.status("CLIENT_TIMEOUT")
        outcome.problems.append(f"{where or 'the call'} did not end within {END_S:g} s of the client's last request")
        return responses, "CLIENT_TIMEOUT"
    except asyncio.CancelledError:
        if not cancelled or _cancelling():
            raise
        code, reason, details = grpc.StatusCode.CANCELLED, "", "cancelled by the client"
    except grpc.aio.AioRpcError as exc:
        if lost_by_client(exc):
            outcome.status(LOST)
            return responses, LOST
        code, reason, details = _rpc_status(exc)
    outcome.grpc_status(code, reason, details, cancelled, where)
    return responses, f"{code.name}/{reason}" if reason else code.name


@dataclass
class SipTarget:
    """The SIP door's process: its SIP port (UDP), its control URL and its log."""

    port: int
    control: str
    log: Any  # a Path
    alive: Callable[[], bool]
    read: int = 0  # how much of its log has been judged

    def errors(self) -> list[str]:
        text = self.log.read_text(errors="replace")
        new, self.read = text[self.read:], len(text)
        return [line for line in new.splitlines() if " ERROR " in line or "Traceback" in line or "Assertion" in line]


@dataclass
class Target:
    """A running server (and bridge) the doors are fuzzed against, and how to see its state."""

    channel: grpc.aio.Channel  # plaintext, to the server's gRPC port
    token: str | None  # a token with no limits (None: the server has authentication off)
    limited_token: str | None  # a token with a session quota
    sessions: Callable[[], Awaitable[int]]  # Converse sessions open now
    alive: Callable[[], Awaitable[bool]]  # the server is up and its health answers SERVING
    errors_logged: Callable[[], list[str]]  # error lines the server logged since the last call
    latent_channels: int
    max_receive_bytes: int
    features: frozenset[str]
    web_url: str | None = None
    http: Any = None  # an aiohttp.ClientSession
    web_peers: Callable[[], Awaitable[int]] | None = None  # the bridge's peers (and offers being answered)
    offer_sdp: str = field(default="", repr=False)  # a real offer (audio, video, data channel), for the web doors to mutate
    baseline_sessions: int = 0  # sessions open that are not the fuzz's (the well-behaved session)
    max_upload_bytes: int = 25 * 1024 * 1024  # the web front's bound on a transcription upload
    # The web front's Realtime limits (rtmedia.web.openai.realtime_ws.RealtimeLimits; these are serve's defaults).
    max_event_bytes: int = 2 * 1024 * 1024
    max_frame_bytes: int = 8 * 1024 * 1024
    sip: SipTarget | None = None  # the SIP door (`rtmedia sip`) in front of the server, when fuzzed

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis's reports
        printer.text(f"Target({self.channel!r}, web {self.web_url})")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


@dataclass(frozen=True)
class Door:
    name: str
    cases: st.SearchStrategy[Any]
    run: Callable[[Target, Any], Awaitable[Outcome]]
    needs: frozenset[str] = frozenset()
    peers: bool = False  # its cases make bridge peers, which only the whole bridge counts: one job at a time


DOORS: dict[str, Door] = {}


def door(name: str, cases: st.SearchStrategy[Any], needs: Iterable[str] = (), peers: bool = False
         ) -> Callable[[Any], Any]:
    """Register the decorated runner as the door `name`, fuzzed with `cases` (see Door for `peers`)."""
    def register(run: Callable[[Target, Any], Awaitable[Outcome]]) -> Callable[[Target, Any], Awaitable[Outcome]]:
        if name in DOORS:
            raise ValueError(f"door {name!r} is registered twice")
        DOORS[name] = Door(name, cases, run, frozenset(needs), peers)
        return run
    return register


def doors_for(features: Iterable[str], names: Iterable[str] | None = None) -> list[Door]:
    """The doors a target with `features` has (all of them, or those named), in registry order."""
    have, wanted = set(features), set(names) if names else None
    if wanted is not None and (unknown := wanted - DOORS.keys()):
        raise ValueError(f"unknown door(s): {', '.join(sorted(unknown))}; doors: {', '.join(DOORS)}")
    return [d for d in DOORS.values() if d.needs <= have and (wanted is None or d.name in wanted)]


@dataclass
class Verdict:
    door: str
    outcome: Outcome
    problems: list[str]
    leaked_sessions: int
    leaked_peers: int
    crashed: bool
    seconds: float


async def _settled(count: Callable[[], Awaitable[int]], baseline: int, within: float) -> int:
    """What `count()` exceeds `baseline` by once it has had `within` seconds to get back to it."""
    deadline = time.monotonic() + within
    while True:
        over = await count() - baseline
        if over <= 0 or time.monotonic() > deadline:
            return max(0, over)
        await asyncio.sleep(0.02)


async def run_case(target: Target, door_: Door, case: Any, settle_s: float = SETTLE_S) -> Verdict:
    """Send one case through its door and judge everything the module docstring lists."""
    started = time.perf_counter()
    outcome = await door_.run(target, case)
    seconds = time.perf_counter() - started
    problems = list(outcome.problems)
    leaked = await _settled(target.sessions, target.baseline_sessions, settle_s)
    if leaked:
        problems.append(f"{leaked} session(s) still open {settle_s:g} s after the case")
    peers = await _settled(target.web_peers, 0, settle_s) if target.web_peers is not None else 0
    if peers:
        problems.append(f"{peers} bridge peer(s) still open {settle_s:g} s after the case")
    crashed = not await target.alive()
    if crashed:
        problems.append("the server stopped answering health (or exited)")
    problems += [f"the server logged an error: {line[:300]}" for line in target.errors_logged()]
    if target.sip is not None:
        problems += [f"the SIP door logged an error: {line[:300]}" for line in target.sip.errors()]
        if not target.sip.alive():
            crashed = True
            problems.append("the SIP door exited")
    return Verdict(door_.name, outcome, problems, leaked, peers, crashed, seconds)


# ---- RealtimeService.Converse -------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    request: realtime_pb2.ConverseRequest
    pause_ms: int


@dataclass(frozen=True)
class ConverseCase:
    steps: tuple[Step, ...]
    ending: str  # close (session.close), half_close (end the requests), cancel (cancel the call)


def _ids() -> st.SearchStrategy[str]:
    return st.one_of(st.just(""), st.text(max_size=12), st.sampled_from(["x" * 257, "é" * 129, "0" * 300]))


def _refs(marker: str) -> st.SearchStrategy[str]:
    return weighted([st.just(marker), st.just(marker), _ids()])


def _words() -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(["hello", "what", "is", "the", "time", "please", "tell", "me", ",", ".", "?"]),
                    max_size=12).map(" ".join)


def _texts() -> st.SearchStrategy[str]:
    words = st.lists(st.sampled_from(["hello", "what", "is", "the", "time", "please", "tell", "me", ",", ".", "?"]),
                     max_size=12).map(" ".join)
    return weighted([words, words, strings()])


def _images() -> st.SearchStrategy[bytes]:
    jpeg, png = b"\xff\xd8\xff\xe0", b"\x89PNG\r\n\x1a\n"
    return st.one_of(
        st.builds(lambda head, body: head + body, st.sampled_from([jpeg, png]), st.binary(max_size=256)),
        st.binary(max_size=64),
        st.builds(lambda head, n: head + b"\0" * n, st.sampled_from([jpeg, png]),
                  st.integers(2 * 1024 * 1024 - 16, 2 * 1024 * 1024 + 16)),
    )


_SESSION = "session_update.session."
CONVERSE_HINTS: dict[str, st.SearchStrategy[Any]] = {
    "event_id": sometimes(_ids()),
    # appends twice as often as any other event: audio drives the turn state machine
    "event": st.sampled_from([None, "input_audio_buffer_append", "input_audio_buffer_append",
                              *(f.name for f in realtime_pb2.ConverseRequest.DESCRIPTOR.oneofs_by_name["event"].fields)]),
    "input_audio_buffer_append.audio": audio(),
    f"{_SESSION}input_audio_format.sample_rate": sometimes(st.one_of(st.sampled_from(RATES), integers(-1, 2**31 - 1))),
    f"{_SESSION}input_audio_format.channels": sometimes(st.sampled_from([0, 1, 2, -1, 8])),
    f"{_SESSION}output_sample_rate": sometimes(st.sampled_from(RATES)),
    f"{_SESSION}responder": sometimes(st.one_of(st.sampled_from(["echo", "echo", "llm", "openai", "", "none"]),
                                                strings())),
    f"{_SESSION}voice": sometimes(st.one_of(st.sampled_from(["", "en_US-joe-medium", "nobody"]), strings())),
    f"{_SESSION}instructions": sometimes(_texts()),
    f"{_SESSION}turn_detection.threshold": sometimes(st.one_of(st.floats(0, 1, width=32),
                                                               st.sampled_from([math.nan, -1.0, 2.0]))),
    f"{_SESSION}turn_detection.prefix_padding_ms": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}turn_detection.silence_duration_ms": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}turn_detection.eagerness": sometimes(st.one_of(st.sampled_from([0, 1, 2, 3, 4]), integers(-1, 99))),
    f"{_SESSION}turn_detection.candidate_ms": sometimes(st.one_of(st.sampled_from([200, 2000, 199, 2001]),
                                                                  integers(-(2**31), 2**31 - 1))),
    f"{_SESSION}turn_detection.max_wait_ms": sometimes(st.one_of(st.sampled_from([500, 30000, 499, 30001]),
                                                                 integers(-(2**31), 2**31 - 1))),
    f"{_SESSION}max_output_tokens": sometimes(integers(-(2**31), 2**31 - 1)),
    f"{_SESSION}idle_timeout_s": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}max_session_s": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}tools.functions": sometimes(st.lists(st.builds(
        realtime_pb2.FunctionTool, name=st.one_of(st.sampled_from(["get_weather", "f", "", "bad name", "x" * 65]),
                                                  strings()),
        description=_texts(), parameters=st.sampled_from(["", "{}", '{"type": "object"}', '{"type": "string"}',
                                                          "{not json", "[1]", "[" * 5000])), max_size=3)),
    f"{_SESSION}tool_choice.name": sometimes(st.sampled_from(["", "get_weather", "f", "missing"])),
    f"{_SESSION}tool_timeout_ms": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}tool_filler_ms": sometimes(integers(-1, 2**31 - 1)),
    "conversation_item_create.item.text": _texts(),
    "conversation_item_create.item.type": sometimes(st.sampled_from(["", "message", "function_call",
                                                                     "function_call_output", "reasoning"])),
    "conversation_item_create.item.call_id": sometimes(st.one_of(st.sampled_from(["call_1", ""]), strings())),
    "conversation_item_create.item.output": sometimes(_texts()),
    "conversation_item_create.item.arguments": sometimes(st.sampled_from(["{}", '{"city": "Paris"}', "not json"])),
    "conversation_item_create.item.role": sometimes(st.sampled_from(["", "user", "assistant", "system", "🙂"])),
    "conversation_item_truncate.item_id": _refs(ITEM_MARKER),
    "response_cancel.response_id": _refs(RESPONSE_OPEN_MARKER),
    "playback_ack.response_id": _refs(RESPONSE_OPEN_MARKER),
    "playback_ack.played_ms": integers(-(2**63), 2**63 - 1),
    "response_create.instructions": sometimes(_texts()),
    "camera_frame.image": _images(),
}

CONVERSE_CASES = st.builds(
    ConverseCase,
    st.lists(st.builds(Step, message(realtime_pb2.ConverseRequest, CONVERSE_HINTS),
                       st.sampled_from([0, 0, 0, 0, 10, 40, 200, 700])), max_size=12).map(tuple),
    st.sampled_from(["close", "close", "half_close", "cancel"]),
)


class _Stream:
    """What a Converse case has seen on its stream: ids to refer to, error codes, whether a
    response is in progress."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.response_id = ""
        self.item_id = ""
        self.responding = False

    def resolve(self, request: realtime_pb2.ConverseRequest) -> realtime_pb2.ConverseRequest:
        kind = request.WhichOneof("event")
        event = getattr(request, kind) if kind else None
        for name, value in (("response_id", self.response_id), ("item_id", self.item_id)):
            if event is not None and name in event.DESCRIPTOR.fields_by_name and \
                    getattr(event, name) in (RESPONSE_OPEN_MARKER, ITEM_MARKER):
                request = type(request).FromString(request.SerializeToString())
                setattr(getattr(request, kind), name, value)
        return request

    def seen(self, event: realtime_pb2.ConverseResponse) -> None:
        kind = event.WhichOneof("event")
        if kind == "response_created":
            self.response_id, self.item_id = event.response_created.response_id, event.response_created.item_id
            self.responding = True
        elif kind == "response_done":
            self.responding = False
        elif kind == "error":
            error = event.error
            self.outcome.error_events[error.code or "<no code>"] += 1
            if error.code == "server_error":
                self.outcome.problems.append(f"error event server_error: {error.message[:300]}")
            elif not error.code or not error.message:
                self.outcome.problems.append(f"an error event without a code or message: {error}")


async def _queue_requests(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    while (request := await queue.get()) is not None:
        yield request


@door("converse", CONVERSE_CASES)
async def converse(target: Target, case: ConverseCase) -> Outcome:
    from rtmedia.v1 import realtime_pb2_grpc

    outcome = Outcome()
    stream = _Stream(outcome)
    queue: asyncio.Queue[Any] = asyncio.Queue()
    call = realtime_pb2_grpc.RealtimeServiceStub(target.channel).Converse(_queue_requests(queue),
                                                                          metadata=target.metadata)

    async def read() -> None:
        async for event in call:
            stream.seen(event)

    reader = asyncio.ensure_future(read())
    try:
        return await _converse_steps(case, queue, stream, call, reader, outcome)
    finally:
        queue.put_nowait(None)  # the request stream ends, whatever happened (its task must not linger)


async def _converse_steps(case: ConverseCase, queue: asyncio.Queue[Any], stream: _Stream, call: Any,
                          reader: asyncio.Future[None], outcome: Outcome) -> Outcome:
    for step in case.steps:
        if step.pause_ms:
            await asyncio.sleep(step.pause_ms / 1000)
        if reader.done():
            break
        queue.put_nowait(stream.resolve(step.request))
    if case.ending == "cancel":
        await asyncio.sleep(0.01)
        call.cancel()
    else:
        if case.ending == "close":
            queue.put_nowait(client_event("session.close", reason="fuzz"))
        queue.put_nowait(None)
    done, _ = await asyncio.wait([reader], timeout=CLOSE_S if case.ending == "close" else END_S)
    if not done:
        if case.ending == "half_close" and stream.responding:
            outcome.status("REPLY_PLAYING")  # a half-closed session answers in full: it is not stuck
        else:
            outcome.problems.append(f"the stream did not end within {CLOSE_S:g} s of {case.ending}")
        call.cancel()
    try:
        await reader
        code, reason, details = grpc.StatusCode.OK, "", ""
    except asyncio.CancelledError:
        if _cancelling():
            raise
        code, reason, details = grpc.StatusCode.CANCELLED, "", "cancelled by the client"
    except grpc.aio.AioRpcError as exc:
        if lost_by_client(exc):
            outcome.status(LOST)
            return outcome
        code, reason, details = _rpc_status(exc)
    if done or code != grpc.StatusCode.CANCELLED:
        outcome.grpc_status(code, reason, details, cancelled=case.ending == "cancel", where="Converse")
    return outcome


# ---- SpeechService ------------------------------------------------------------------------------------

def _streamed(cls: type[Message], oneof: str, first: list[str | None], later: list[str | None],
              hints: dict[str, st.SearchStrategy[Any]], max_size: int = 6) -> st.SearchStrategy[list[Message]]:
    """A stream of `cls` requests: the first's `oneof` member drawn from `first`, the rest's from `later`."""
    head = message(cls, {**hints, oneof: st.sampled_from(first)})
    tail = message(cls, {**hints, oneof: st.sampled_from(later)})
    return st.builds(lambda h, t: [h, *t], head, st.lists(tail, max_size=max_size))


TRANSCRIBE_HINTS = {
    "config.audio_format.sample_rate": sometimes(st.sampled_from(RATES)),
    "config.audio_format.channels": sometimes(st.sampled_from([0, 1, 2, -1])),
    "config.language": sometimes(st.sampled_from(["", "en-US", "en", "fr-FR", "x" * 300])),
    "audio": audio(max_huge=256 * 1024),
}
TRANSCRIBE_CASES = st.one_of(
    _streamed(speech_pb2.TranscribeRequest, "request", ["config", "config", "config", "audio", None],
              ["audio", "audio", "audio", "audio", "config", None], TRANSCRIBE_HINTS),
    st.just([]),
)


@door("transcribe", TRANSCRIBE_CASES)
async def transcribe(target: Target, requests: list[speech_pb2.TranscribeRequest]) -> Outcome:
    from rtmedia.v1 import speech_pb2_grpc

    outcome = Outcome()
    call = paced(speech_pb2_grpc.SpeechServiceStub(target.channel).Transcribe, requests, metadata=target.metadata)
    await finish(call, outcome, where="Transcribe")
    return outcome


SYNTHESIZE_HINTS = {
    "text": st.one_of(_texts(), st.sampled_from(["", "   ", "!?.,", "x" * 5001, "a" * 5000 + " b"])),
    "voice": sometimes(st.one_of(st.sampled_from(["", "en_US-joe-medium", "nobody"]), strings())),
    "sample_rate": sometimes(st.one_of(st.sampled_from(RATES), integers(-(2**31), 2**31 - 1))),
}


def _short_text(request: Message, limit: int = 400) -> bool:
    """Texts the server would accept are kept short: a case is about the request, not synthesis time."""
    text = request.text.strip()
    return len(text) <= limit or len(request.text) > 5000


@door("synthesize", message(speech_pb2.SynthesizeRequest, SYNTHESIZE_HINTS).filter(_short_text))
async def synthesize(target: Target, request: speech_pb2.SynthesizeRequest) -> Outcome:
    from rtmedia.v1 import speech_pb2_grpc

    outcome = Outcome()
    await finish(speech_pb2_grpc.SpeechServiceStub(target.channel).Synthesize(request, metadata=target.metadata),
                 outcome, where="Synthesize")
    return outcome


# ---- VideoService.DecodeVideo ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LatentSpec:
    shape: tuple[int, ...]
    dtype: int
    data: str  # exact (finite values of the right length), nonfinite, short, long, random
    seed: int


# Per dimension of a latent (C, T, H, W): values a VAE takes, and values it must refuse.
_DIMS = {
    0: ([CHANNELS_MARKER], [1, 0, -1, 3]),
    1: ([1, 2, 3, 4, 5], [0, -1, 129, 2**40]),
    2: ([1, 2, 4, 8, 3], [0, -2, 161, 2**31]),
    3: ([1, 2, 4, 8, 5], [0, -2, 161, 2**31]),
}


def _dimension(i: int) -> st.SearchStrategy[int]:
    good, bad = _DIMS.get(i, ([1, 2], [0]))
    return st.sampled_from(good * 8 + bad)


LATENTS = st.sampled_from([4, 4, 4, 4, 4, 0, 1, 3, 5]).flatmap(lambda rank: st.builds(
    LatentSpec,
    st.tuples(*[_dimension(i) for i in range(rank)]),
    st.one_of(st.sampled_from([1, 1, 2, 3]), st.integers(-2, 9)),
    st.sampled_from(["exact", "exact", "exact", "nonfinite", "short", "long", "random"]),
    st.integers(0, 2**16),
))
VIDEO_HINTS = {
    "latent": st.just(UNSET),  # built from the LatentSpec by the runner
    "width": sometimes(st.sampled_from([0, 2, 4, 8, 16, 7, 33, -1, 10**6, 2**31 - 1])),
    "height": sometimes(st.sampled_from([0, 2, 4, 8, 16, 7, 33, -1, 10**6, 2**31 - 1])),
    "latent_steps_per_chunk": sometimes(st.sampled_from([0, 1, 2, 3, 100, -1, 2**31 - 1])),
    "fps": sometimes(st.one_of(st.sampled_from([0.0, 16.0, 0.1, 240.0, 0.09, 241.0, -1.0, math.nan, math.inf]),
                               st.floats(width=32))),
}
VIDEO_CASES = st.tuples(message(video_pb2.DecodeVideoRequest, VIDEO_HINTS), LATENTS)
DTYPE_SIZES = {video_pb2.TENSOR_DTYPE_FLOAT32: (np.float32, 4), video_pb2.TENSOR_DTYPE_FLOAT16: (np.float16, 2),
               video_pb2.TENSOR_DTYPE_BFLOAT16: (np.float32, 2)}
MAX_EXACT_BYTES = 2 * 1024 * 1024


def latent_tensor(spec: LatentSpec, channels: int) -> video_pb2.Tensor:
    shape = [channels if d == CHANNELS_MARKER else d for d in spec.shape]
    rng = np.random.default_rng(spec.seed)
    dtype, size = DTYPE_SIZES.get(spec.dtype, (np.float32, 4))
    count = math.prod(shape) if shape and all(d > 0 for d in shape) else 0
    if spec.data in ("exact", "nonfinite") and 0 < count * size <= MAX_EXACT_BYTES:
        values = rng.standard_normal(count).astype(np.float32)
        if spec.data == "nonfinite":
            values[int(rng.integers(count))] = rng.choice([np.nan, np.inf, -np.inf])
        if spec.dtype == video_pb2.TENSOR_DTYPE_BFLOAT16:  # the upper half of each float32
            data = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            data = values.astype(dtype).astype(dtype().dtype.newbyteorder("<")).tobytes()
    elif spec.data in ("short", "long") and 0 < count * size <= MAX_EXACT_BYTES:
        data = rng.bytes(count * size + (-1 if spec.data == "short" else 1) * int(rng.integers(1, 9)))
    else:
        data = rng.bytes(int(rng.integers(0, 4096)))
    return video_pb2.Tensor(shape=shape, dtype=spec.dtype, data=data)


@door("decode_video", VIDEO_CASES)
async def decode_video(target: Target, case: tuple[video_pb2.DecodeVideoRequest, LatentSpec]) -> Outcome:
    from rtmedia.v1 import video_pb2_grpc

    request, spec = case
    request = video_pb2.DecodeVideoRequest.FromString(request.SerializeToString())
    request.latent.CopyFrom(latent_tensor(spec, target.latent_channels))
    outcome = Outcome()
    await finish(video_pb2_grpc.VideoServiceStub(target.channel).DecodeVideo(request, metadata=target.metadata),
                 outcome, where="DecodeVideo")
    return outcome


# ---- the Riva speech API -------------------------------------------------------------------------------

def _wav(rate: int, width: int, channels: int, frames: bytes, truncate: int) -> bytes:
    out = BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(frames[: len(frames) - len(frames) % (width * channels)])
    data = out.getvalue()
    return data[:truncate] if truncate else data


RIVA_AUDIO = st.one_of(
    audio(max_huge=256 * 1024),
    st.builds(_wav, st.sampled_from([8000, 16000, 22050, 44100, 1]), st.sampled_from([2, 2, 1, 3]),
              st.sampled_from([1, 1, 2]), audio(max_huge=0), st.sampled_from([0, 0, 0, 12, 44, 45])),
    st.builds(lambda tail: b"RIFF\x24\x00\x00\x00WAVE" + tail, st.binary(max_size=64)),
)
RIVA_CONFIG_HINTS = {
    "encoding": sometimes(st.one_of(st.sampled_from(sorted(riva_audio_pb2.AudioEncoding.values())),
                                    st.integers(-1, 40)), 1, 2),
    "sample_rate_hertz": sometimes(st.sampled_from(RATES), 6, 1),
    "language_code": sometimes(st.sampled_from(["", "en-US", "en-us", "de-DE", "x" * 300]), 1, 2),
    "model": sometimes(st.sampled_from(["", "whisper-tiny-en-US-asr-streaming", "pocketsphinx-en-US-asr-streaming",
                                         "nope"]), 1, 3),
    "max_alternatives": sometimes(integers(-(2**31), 2**31 - 1), 1, 3),
    "audio_channel_count": sometimes(st.sampled_from([0, 1, 2, -1]), 1, 3),
    "profanity_filter": sometimes(st.booleans(), 1, 6),
    "enable_separate_recognition_per_channel": sometimes(st.booleans(), 1, 6),
    "speech_contexts": sometimes(st.lists(message(riva_asr_pb2.SpeechContext), max_size=2), 1, 6),
    "diarization_config": sometimes(message(riva_asr_pb2.SpeakerDiarizationConfig), 1, 6),
    "custom_configuration": sometimes(st.dictionaries(strings(), strings(), max_size=2), 1, 6),
    "endpointing_config": sometimes(message(riva_asr_pb2.EndpointingConfig, {
        "start_history": sometimes(integers(-1, 100000)), "stop_history": sometimes(integers(-1, 100000)),
        "start_threshold": sometimes(st.floats(-1, 2, width=32)), "stop_threshold": sometimes(st.floats(-1, 2, width=32)),
        "stop_history_eou": sometimes(integers(-1, 2000), 1, 4),
        "stop_threshold_eou": sometimes(st.floats(-1, 2, width=32), 1, 4),
    }), 1, 2),
}


RECOGNIZE_HINTS = {"audio": RIVA_AUDIO,
                   "config": sometimes(message(riva_asr_pb2.RecognitionConfig, RIVA_CONFIG_HINTS), 6, 1)}


@door("riva_recognize", message(riva_asr_pb2.RecognizeRequest, RECOGNIZE_HINTS), needs=["riva"])
async def riva_recognize(target: Target, request: riva_asr_pb2.RecognizeRequest) -> Outcome:
    from riva.client.proto import riva_asr_pb2_grpc

    outcome = Outcome()
    stub = riva_asr_pb2_grpc.RivaSpeechRecognitionStub(target.channel)
    await finish(stub.Recognize(request, metadata=target.metadata), outcome, where="Recognize")
    return outcome


STREAMING_HINTS = {
    "streaming_config.config": message(riva_asr_pb2.RecognitionConfig, RIVA_CONFIG_HINTS),
    "audio_content": audio(max_huge=256 * 1024),
    "runtime_config": sometimes(st.dictionaries(strings(), strings(), max_size=2), 1, 6),
}


@door("riva_streaming_recognize",
      _streamed(riva_asr_pb2.StreamingRecognizeRequest, "streaming_request",
                ["streaming_config", "streaming_config", "streaming_config", "audio_content", None],
                ["audio_content", "audio_content", "audio_content", "streaming_config", None], STREAMING_HINTS),
      needs=["riva"])
async def riva_streaming_recognize(target: Target, requests: list[riva_asr_pb2.StreamingRecognizeRequest]) -> Outcome:
    from riva.client.proto import riva_asr_pb2_grpc

    outcome = Outcome()
    stub = riva_asr_pb2_grpc.RivaSpeechRecognitionStub(target.channel)
    await finish(paced(stub.StreamingRecognize, requests, metadata=target.metadata), outcome,
                 where="StreamingRecognize")
    return outcome


RIVA_TTS_HINTS = {
    "text": st.one_of(_texts(), st.sampled_from(["", "   ", "!?.,", "x" * 5001])),
    "language_code": sometimes(st.sampled_from(["", "en-US", "EN-us", "de-DE"]), 1, 2),
    "encoding": sometimes(st.one_of(st.sampled_from(sorted(riva_audio_pb2.AudioEncoding.values())),
                                    st.integers(-1, 40)), 1, 2),
    "sample_rate_hz": sometimes(st.sampled_from(RATES), 1, 1),
    "voice_name": sometimes(st.sampled_from(["", "en_US-joe-medium", "nobody"]), 1, 2),
    "zero_shot_data": sometimes(message(riva_tts_pb2.ZeroShotData, {"audio_prompt": blobs(1024)}), 1, 8),
    "custom_dictionary": sometimes(strings(), 1, 8),
    "enable_word_time_offsets": sometimes(st.booleans(), 1, 8),
    "custom_configuration": sometimes(st.dictionaries(strings(), strings(), max_size=2), 1, 8),
}


@door("riva_synthesize", message(riva_tts_pb2.SynthesizeSpeechRequest, RIVA_TTS_HINTS).filter(_short_text),
      needs=["riva"])
async def riva_synthesize(target: Target, request: riva_tts_pb2.SynthesizeSpeechRequest) -> Outcome:
    from riva.client.proto import riva_tts_pb2_grpc

    outcome = Outcome()
    stub = riva_tts_pb2_grpc.RivaSpeechSynthesisStub(target.channel)
    await finish(stub.Synthesize(request, metadata=target.metadata), outcome, where="Synthesize")
    return outcome


def _online(first: riva_tts_pb2.SynthesizeSpeechRequest, later: list[tuple[bool, str, Message]]) -> list[Message]:
    """A SynthesizeOnline stream: after `first`, text deltas with the same settings (or, where
    the flag says so, any other request)."""
    requests: list[Message] = [first]
    for same, text, other in later:
        if same:
            request = riva_tts_pb2.SynthesizeSpeechRequest.FromString(first.SerializeToString())
            request.text = text
        else:
            request = other
        requests.append(request)
    return requests


RIVA_ONLINE_CASES = st.one_of(st.just([]), st.builds(
    _online, message(riva_tts_pb2.SynthesizeSpeechRequest, RIVA_TTS_HINTS).filter(_short_text),
    st.lists(st.tuples(st.sampled_from([True, True, True, False]),
                       st.one_of(_words(), st.text(max_size=20), st.sampled_from(["", " ", "\n", "x" * 5001])),
                       message(riva_tts_pb2.SynthesizeSpeechRequest, RIVA_TTS_HINTS).filter(_short_text)),
             max_size=5),
))


@door("riva_synthesize_online", RIVA_ONLINE_CASES, needs=["riva"])
async def riva_synthesize_online(target: Target, requests: list[Message]) -> Outcome:
    from riva.client.proto import riva_tts_pb2_grpc

    outcome = Outcome()
    stub = riva_tts_pb2_grpc.RivaSpeechSynthesisStub(target.channel)
    await finish(paced(stub.SynthesizeOnline, requests, metadata=target.metadata), outcome, where="SynthesizeOnline")
    return outcome


# ---- raw bytes on every method --------------------------------------------------------------------------

@dataclass(frozen=True)
class Method:
    path: str
    client_streaming: bool
    server_streaming: bool
    needs: frozenset[str]


def _methods() -> list[Method]:
    """Every method the server serves (but health's Watch, a stream that never ends by design)."""
    modules = [(realtime_pb2, ()), (speech_pb2, ()), (video_pb2, ()), (riva_asr_pb2, ("riva",)),
               (riva_tts_pb2, ("riva",)), (health_pb2, ()), (reflection_pb2, ())]
    methods = []
    for module, needs in modules:
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                path = f"/{service.full_name}/{m.name}"
                if path != "/grpc.health.v1.Health/Watch":
                    methods.append(Method(path, m.client_streaming, m.server_streaming, frozenset(needs)))
    return methods


METHODS = _methods()
GARBAGE = b"\xff\xff\xff\xff\x0f"  # a field header whose varint never ends
SESSION_CLOSE = client_event("session.close", reason="fuzz").SerializeToString()


def undecodable() -> st.SearchStrategy[bytes]:
    """Bytes no message decodes from: anything, then a length-delimited field cut short."""
    return st.one_of(st.just(GARBAGE), st.builds(lambda head: head + b"\x0a\xff\xff\x7f", st.binary(max_size=48)),
                     st.builds(lambda head: head + GARBAGE, st.binary(max_size=48)))


def _method_call(target: Target, method: Method, messages: list[bytes]) -> Any:
    kind = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming else "unary")
    factory = getattr(target.channel, kind)(method.path, request_serializer=None, response_deserializer=None)
    if method.client_streaming:
        return paced(factory, messages, metadata=target.metadata)
    return factory(messages[0], metadata=target.metadata)


RAW_CASES = st.tuples(st.sampled_from(METHODS), st.lists(st.one_of(undecodable(), undecodable(), blobs(256)),
                                                         min_size=1, max_size=3))


def _served(target: Target, method: Method) -> bool:
    return method.needs <= target.features


@door("raw_bytes", RAW_CASES)
async def raw_bytes(target: Target, case: tuple[Method, list[bytes]]) -> Outcome:
    method, messages = case
    outcome = Outcome()
    if not _served(target, method):
        return outcome
    if method.path.endswith("/Converse"):  # a stream whose bytes all decode still ends
        messages = [*messages, SESSION_CLOSE]
    await finish(_method_call(target, method, messages), outcome, where=method.path)
    return outcome


@dataclass(frozen=True)
class Oversize:
    method: Method
    over: int  # bytes over the receive limit
    second: bool  # a stream's second message (after an empty first one), else its first


@door("oversize", st.builds(Oversize, st.sampled_from(METHODS), st.integers(1, 1 << 20), st.booleans()))
async def oversize(target: Target, case: Oversize) -> Outcome:
    outcome = Outcome()
    if not _served(target, case.method):
        return outcome
    big = b"\x12" + _varint(target.max_receive_bytes + case.over) + bytes(target.max_receive_bytes + case.over)
    messages = [b"", big] if case.second and case.method.client_streaming else [big]
    await finish(_method_call(target, case.method, messages), outcome, where=case.method.path)
    return outcome


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# ---- floods ---------------------------------------------------------------------------------------------

FLOODS = ("list_voices", "converse_open_close", "converse_errors", "bad_synthesize", "transcribe_chunks",
          "health", "undecodable")


@door("flood", st.tuples(st.sampled_from(FLOODS), st.integers(2, 80), st.integers(0, 20), st.integers(1, 160)))
async def flood(target: Target, case: tuple[str, int, int, int]) -> Outcome:
    """Many calls at once, `spacing` ms apart (or one stream with very many requests, of `size`
    samples of audio or an event id of `size` characters)."""
    from grpc_health.v1 import health_pb2_grpc
    from rtmedia.v1 import realtime_pb2_grpc, speech_pb2_grpc

    kind, n, spacing, size = case
    outcome = Outcome()
    speech = speech_pb2_grpc.SpeechServiceStub(target.channel)
    realtime = realtime_pb2_grpc.RealtimeServiceStub(target.channel)
    md = target.metadata
    if kind == "converse_errors":  # one stream, each of its many events answered with an error
        events = [client_event("response.cancel", event_id=f"{i:0{size}d}") for i in range(n * 50)]
        events.append(client_event("session.close"))
        stream = _Stream(outcome)
        call = realtime.Converse(iter(events), metadata=md)
        for event in await finish(call, outcome, where="Converse"):
            stream.seen(event)
        return outcome
    if kind == "transcribe_chunks":
        chunks = [speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig())]
        chunks += [speech_pb2.TranscribeRequest(audio=b"\0\0" * size) for _ in range(n * 50)]
        await finish(speech.Transcribe(iter(chunks), metadata=md), outcome, where="Transcribe")
        return outcome

    def one() -> Any:
        if kind == "list_voices":
            return speech.ListVoices(speech_pb2.ListVoicesRequest(), metadata=md)
        if kind == "bad_synthesize":
            return speech.Synthesize(speech_pb2.SynthesizeRequest(text=""), metadata=md)
        if kind == "health":
            return health_pb2_grpc.HealthStub(target.channel).Check(health_pb2.HealthCheckRequest())
        if kind == "undecodable":
            method = next(m for m in METHODS if m.path.endswith("/Synthesize") and "riva" not in m.path)
            return _method_call(target, method, [GARBAGE])
        return realtime.Converse(iter([client_event("session.close")]), metadata=md)

    async def spaced(i: int) -> None:
        await asyncio.sleep(i * spacing / 1000)
        await finish(one(), outcome, where=kind)

    await asyncio.gather(*(spaced(i) for i in range(n)))
    return outcome


# ---- tokens ---------------------------------------------------------------------------------------------

CREDENTIALS = ("none", "wrong", "malformed", "basic", "empty_bearer", "good", "limited")
AUTH_METHODS = ("list_voices", "converse", "synthesize", "riva_config", "health", "decode_video")


@dataclass(frozen=True)
class AuthCall:
    credential: str
    method: str
    junk: str  # the malformed header value


def _authorization(target: Target, call: AuthCall) -> tuple[tuple[str, str], ...]:
    value = {
        "none": None, "wrong": "Bearer wrong-token-0123456789abcdef", "malformed": call.junk or "x",
        "basic": f"Basic {target.token}", "empty_bearer": "Bearer ", "good": f"Bearer {target.token}",
        "limited": f"Bearer {target.limited_token}",
    }[call.credential]
    return (("authorization", value),) if value else ()


AUTH_CASES = st.lists(st.builds(AuthCall, st.sampled_from(CREDENTIALS), st.sampled_from(AUTH_METHODS),
                                header_values(200)), min_size=1, max_size=40)


@door("auth", AUTH_CASES, needs=["auth"])
async def auth(target: Target, calls: list[AuthCall]) -> Outcome:
    """Floods of calls without a token, with a wrong or malformed one, or with a quota's, at once."""
    from grpc_health.v1 import health_pb2_grpc
    from riva.client.proto import riva_tts_pb2_grpc
    from rtmedia.v1 import realtime_pb2_grpc, speech_pb2_grpc, video_pb2_grpc

    outcome = Outcome()

    async def one(call: AuthCall) -> None:
        md = _authorization(target, call)
        if call.method == "list_voices":
            rpc = speech_pb2_grpc.SpeechServiceStub(target.channel).ListVoices(speech_pb2.ListVoicesRequest(),
                                                                               metadata=md)
        elif call.method == "converse":
            rpc = paced(realtime_pb2_grpc.RealtimeServiceStub(target.channel).Converse,
                        [client_event("session.close")], metadata=md)
        elif call.method == "synthesize":
            rpc = speech_pb2_grpc.SpeechServiceStub(target.channel).Synthesize(
                speech_pb2.SynthesizeRequest(text="hi", sample_rate=7), metadata=md)
        elif call.method == "riva_config" and "riva" in target.features:
            rpc = riva_tts_pb2_grpc.RivaSpeechSynthesisStub(target.channel).GetRivaSynthesisConfig(
                riva_tts_pb2.RivaSynthesisConfigRequest(), metadata=md)
        elif call.method == "decode_video":
            rpc = video_pb2_grpc.VideoServiceStub(target.channel).DecodeVideo(video_pb2.DecodeVideoRequest(),
                                                                              metadata=md)
        else:
            rpc = health_pb2_grpc.HealthStub(target.channel).Check(health_pb2.HealthCheckRequest(), metadata=md)
        _, status = await ended(rpc, outcome, where=f"{call.method} ({call.credential})")
        valid = call.credential in ("good", "limited")
        refused = status == "UNAUTHENTICATED/UNAUTHENTICATED"
        if call.method != "health" and not valid and not refused and status not in ("CLIENT_TIMEOUT", LOST):
            outcome.problems.append(f"{call.method} with credential {call.credential} was not refused: {status}")
        if valid and status.startswith("UNAUTHENTICATED"):
            outcome.problems.append(f"{call.method} with a valid token was refused: {status}")

    await asyncio.gather(*(one(call) for call in calls))
    return outcome


# ---- the web port (web/bridge.py) -------------------------------------------------------------------------

WEB_CREDENTIALS = ("good", "good", "good", "good", "good", "none", "wrong", "malformed")
CONTENT_TYPES = ("application/json", "application/sdp", "text/plain", "", "application/json; charset=utf-8",
                 "application/json; charset=latin-1", "application/json; charset=nonsense",
                 "application/sdp; charset=ascii", "multipart/form-data; boundary=x",
                 "application/x-www-form-urlencoded")
EXTRA_HEADERS = ("Origin", "Cookie", "User-Agent", "X-Forwarded-For", "Accept", "Sec-WebSocket-Protocol",
                 "Upgrade", "Connection")


@dataclass(frozen=True)
class WebCall:
    method: str
    path: str  # may hold {peer}: a path segment
    segment: str
    body: Any  # bytes, or ("offer", edits, type, extra fields), or ("sdp", edits), or ("json", value)
    content_type: str
    credential: str
    junk: str
    headers: tuple[tuple[str, str], ...]


def _content_types() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(CONTENT_TYPES), header_values(40))


def _headers() -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    return st.lists(st.tuples(st.sampled_from(EXTRA_HEADERS),
                              st.one_of(header_values(), st.just("websocket"),
                                        st.builds(lambda t: f"rtmedia.bearer.{t}", header_values(40)))),
                    max_size=3).map(tuple)


OFFER_BODIES = st.one_of(
    st.tuples(st.just("offer"), sdp_edits(), st.sampled_from(["offer", "offer", "answer", "", None, 1]),
              st.dictionaries(st.text(max_size=8), json_values(4), max_size=2)),
    st.tuples(st.just("json"), json_values()),
    st.binary(max_size=256),
)
WHIP_BODIES = st.one_of(st.tuples(st.just("sdp"), sdp_edits()), st.binary(max_size=256),
                        st.text(max_size=200).map(str.encode))


def _web_call(method: st.SearchStrategy[str], path: st.SearchStrategy[str], bodies: st.SearchStrategy[Any],
              content_types: st.SearchStrategy[str]) -> st.SearchStrategy[WebCall]:
    return st.builds(WebCall, method, path, path_segments(), bodies, content_types, st.sampled_from(WEB_CREDENTIALS),
                      header_values(60), _headers())


WEB_OFFER = _web_call(st.just("POST"), st.just("/offer"), OFFER_BODIES,
                      weighted([st.just("application/json")] * 3 + [_content_types()]))
WEB_WHIP = _web_call(st.just("POST"), st.just("/whip"), WHIP_BODIES,
                     weighted([st.just("application/sdp")] * 3 + [_content_types()]))
WEB_ROUTES = _web_call(st.sampled_from(["GET", "DELETE", "PATCH", "OPTIONS", "PUT", "POST", "HEAD"]),
                       st.sampled_from(["/peers/{peer}", "/whip/{peer}", "/whip", "/offer", "/healthz", "/config",
                                        "/", "/static/{peer}", "/{peer}", "/peers/{peer}/{peer}", "/v1/models",
                                        "/v1/models/{peer}", "/v1/{peer}", "/v1/audio/{peer}"]),
                       st.one_of(st.binary(max_size=64), st.tuples(st.just("json"), json_values(6))), _content_types())
OPEN_PATHS = ("/", "/healthz")


def _web_body(target: Target, body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    if body[0] == "multipart":
        return multipart_body(target, body[1])
    if body[0] == "sdp":
        return apply_edits(target.offer_sdp, body[1]).encode("utf-8", "surrogatepass")
    if body[0] == "json":
        return json.dumps(body[1]).encode()
    _, edits, kind, extra = body
    return json.dumps({**extra, "sdp": apply_edits(target.offer_sdp, edits), "type": kind}).encode()


def _web_headers(target: Target, call: WebCall) -> dict[str, str]:
    headers = dict(call.headers)
    if call.content_type:
        headers["Content-Type"] = call.content_type
    token = {"good": target.token, "wrong": "wrong-token-0123456789abcdef"}.get(call.credential)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    elif call.credential == "malformed" and call.junk:
        headers["Authorization"] = call.junk
    return headers


async def _web(target: Target, call: WebCall) -> Outcome:
    import aiohttp
    from yarl import URL

    outcome = Outcome()
    path = call.path.replace("{peer}", quote(call.segment, safe=""))
    url = URL(f"{target.web_url}{path}", encoded=True)
    try:
        async with target.http.request(call.method, url, data=_web_body(target, call.body),
                                       headers=_web_headers(target, call),
                                       timeout=aiohttp.ClientTimeout(total=END_S * 2)) as res:
            body = await res.read()
            status, content_type = res.status, res.content_type
            location = res.headers.get("Location", "")
    except TimeoutError:
        outcome.status("CLIENT_TIMEOUT")
        outcome.problems.append(f"{call.method} {path[:80]} got no answer within {END_S * 2:g} s")
        return outcome
    reason = ""
    parsed: Any = None
    if content_type == "application/json":
        with contextlib.suppress(ValueError):
            parsed = json.loads(body)
            reason = parsed.get("reason", "") if isinstance(parsed, dict) else ""
            if _openai_error(parsed):  # OpenAI's shape: its code (or type) is the reason
                reason = parsed["error"].get("code") or parsed["error"]["type"]
    outcome.status(f"HTTP {status}", reason)
    where = f"{call.method} {path[:80]}"
    if status >= 500 and status not in (502, 503):
        outcome.problems.append(f"{where}: HTTP {status}: {body[:300]!r}")
    if status >= 400 and call.method != "HEAD" and not (isinstance(parsed, dict) and parsed.get("error")):
        outcome.problems.append(f"{where}: HTTP {status} without the bridge's JSON error: {body[:300]!r}")
    elif status >= 400 and call.method != "HEAD" and path.startswith("/v1/") and not _openai_error(parsed):
        outcome.problems.append(f"{where}: HTTP {status} without OpenAI's error object: {body[:300]!r}")
    valid = call.credential == "good" or target.token is None
    if target.token and not valid and status < 400 and path not in OPEN_PATHS and \
            not (call.method in ("GET", "HEAD") and path.startswith("/static/")):
        outcome.problems.append(f"{where}: HTTP {status} without a valid token")
    if target.token and call.credential == "good" and status == 401:
        outcome.problems.append(f"{where}: HTTP 401 with a valid token: {body[:300]!r}")
    # A peer the case made is ended by its own id, as its browser would.
    peer = ""
    if status == 200 and path == "/offer" and isinstance(parsed, dict):
        peer = f"/peers/{parsed.get('id', '')}"
    elif status == 201 and location.startswith("/whip/"):
        peer = location
    if peer:
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        async with target.http.delete(f"{target.web_url}{peer}", headers=headers) as res:
            if res.status != 200:
                outcome.problems.append(f"DELETE {peer[:20]}... of a peer this case made: HTTP {res.status}")
    return outcome


@door("web_offer", WEB_OFFER, needs=["web"], peers=True)
async def web_offer(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)


@door("web_whip", WEB_WHIP, needs=["web"], peers=True)
async def web_whip(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)


@door("web_routes", WEB_ROUTES, needs=["web"], peers=True)
async def web_routes(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)


# ---- OpenAI's audio APIs on the web port (web/openai_*.py) -------------------------------------------------

def _openai_error(parsed: Any) -> bool:
    """Whether a JSON body is OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return isinstance(error, dict) and bool(error.get("message")) and isinstance(error.get("type"), str) and \
        {"param", "code"} <= error.keys()


SPEAKABLE = ("Hello there.", "Open the window, please.", "Nine o'clock.", "Yes")
SPEECH_FIELDS = {
    "model": weighted([st.just("tts-1")] * 3 + [st.sampled_from(["gpt-4o-mini-tts", "rtmedia-piper", "whisper-1",
                                                                  ""]), json_values(2)]),
    "input": weighted([st.sampled_from(SPEAKABLE)] * 4 + [strings(60), json_values(2), long_text(4990, 5010)]),
    "voice": st.one_of(st.sampled_from(["alloy", "en_US-joe-medium", "nobody", "", "verse"]), json_values(2),
                       st.fixed_dictionaries({"id": st.sampled_from(["alloy", "x"])})),
    "response_format": st.one_of(st.sampled_from(["mp3", "opus", "aac", "flac", "wav", "pcm", "xml", ""]),
                                 json_values(1)),
    "speed": st.one_of(st.sampled_from([0.25, 1, 1.5, 4, 0, 4.01, 0.2]), floats(), json_values(1)),
    "stream_format": st.one_of(st.sampled_from(["audio", "sse", "x"]), json_values(1)),
    "sample_rate": st.one_of(st.sampled_from((*RATES, -1, 10**12)), json_values(1)),
    "instructions": st.one_of(strings(40), json_values(1)),
}
OPENAI_SPEECH = _web_call(
    st.just("POST"), st.just("/v1/audio/speech"),
    weighted([st.tuples(st.just("json"), st.fixed_dictionaries({}, optional=SPEECH_FIELDS))] * 6
             + [st.tuples(st.just("json"), json_values()), st.binary(max_size=256)]),
    weighted([st.just("application/json")] * 4 + [_content_types()]))

BOUNDARY = "rtmedia-fuzz-boundary"
SAMPLE_KINDS = ("wav", "mp3", "ogg", "m4a", "flac")
TRANSCRIPTION_FIELDS = {
    "model": weighted([st.just("whisper-1")] * 4 + [st.sampled_from(["gpt-4o-transcribe", "tts-1", ""]),
                                                    header_values(20)]),
    "language": st.one_of(st.sampled_from(["en", "en-US", "", "fr", "EN"]), header_values(10)),
    "response_format": st.one_of(st.sampled_from(["json", "text", "verbose_json", "srt", "vtt", "xml"]),
                                 header_values(10)),
    "stream": st.sampled_from(["true", "false", "1", "yes", ""]),
    "timestamp_granularities[]": st.sampled_from(["word", "segment", "char", ""]),
    "temperature": st.sampled_from(["0", "0.5", "warm", "nan", "-1"]),
    "prompt": header_values(40),
    "include[]": st.sampled_from(["logprobs", "x"]),
}
# The file part: a real recording (whole, cut short, or with bytes overwritten), garbage, empty, or
# none; then the whole body may be cut short or be over the front's upload limit.
UPLOAD_FILES = st.one_of(
    st.tuples(st.just("real"), st.sampled_from(SAMPLE_KINDS), st.none()),
    st.tuples(st.just("cut"), st.sampled_from(SAMPLE_KINDS), st.floats(0, 1)),
    st.tuples(st.just("flipped"), st.sampled_from(SAMPLE_KINDS),
              st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=16)),
    st.tuples(st.just("junk"), st.binary(max_size=4096), st.none()),
    st.tuples(st.just("empty"), st.none(), st.none()),
    st.none(),
)
MULTIPART = st.tuples(st.just("multipart"), st.tuples(
    st.fixed_dictionaries({}, optional=TRANSCRIPTION_FIELDS), UPLOAD_FILES, st.sampled_from(["a.wav", "", "x/../y"]),
    weighted([st.just("whole")] * 8 + [st.sampled_from(["cut", "no-end", "oversize"])]), st.floats(0, 1)))
OPENAI_TRANSCRIPTION = _web_call(
    st.just("POST"), st.just("/v1/audio/transcriptions"),
    weighted([MULTIPART] * 6 + [st.binary(max_size=256), st.tuples(st.just("json"), json_values(4))]),
    weighted([st.just(f"multipart/form-data; boundary={BOUNDARY}")] * 6 + [_content_types()]))


@functools.cache
def sample_file(kind: str) -> bytes:
    """A short real recording as a `kind` file (made once per process)."""
    from tests.support.audio_files import encode

    pcm = np.frombuffer(speech_pcm(16000), np.int16)
    return encode(pcm, 16000, kind)


def _upload_file(spec: Any) -> bytes | None:
    if spec is None:
        return None
    what, kind, detail = spec
    if what == "junk":
        return kind
    if what == "empty":
        return b""
    data = sample_file(kind)
    if what == "cut":
        return data[:int(len(data) * detail)]
    if what == "flipped":
        data = bytearray(data)
        for at, value in detail:
            data[min(len(data) - 1, int(len(data) * at))] = value
        return bytes(data)
    return data


def multipart_body(target: Target, parts: Any) -> bytes:
    """A multipart/form-data body (boundary BOUNDARY) of the case's fields and file, possibly
    cut short, without its closing boundary, or over the front's upload limit."""
    fields, file_spec, filename, ending, cut = parts
    out = b""
    for name, value in fields.items():
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n"
                .encode() + value.encode("utf-8", "surrogatepass") + b"\r\n")
    data = _upload_file(file_spec)
    if ending == "oversize":
        data = bytes(target.max_upload_bytes + 1)
    if data is not None:
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
                "Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"
    if ending != "no-end":
        out += f"--{BOUNDARY}--\r\n".encode()
    return out[:int(len(out) * cut)] if ending == "cut" else out


@door("openai_speech", OPENAI_SPEECH, needs=["web", "openai"])
async def openai_speech(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)


@door("openai_transcription", OPENAI_TRANSCRIPTION, needs=["web", "openai"])
async def openai_transcription(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)


# ---- OpenAI's Realtime API on the web port (web/openai/realtime_ws.py) --------------------------------------------

RT_PATH = "/v1/realtime"
# A valid key in three cases of four (in the header, or as a browser's subprotocol), else a wrong or no key.
RT_CREDENTIALS = ("bearer",) * 10 + ("protocol",) * 3 + ("rtmedia_protocol", "wrong", "wrong_protocol",
                                                         "empty_protocol", "none", "malformed")
RT_MODELS = ("gpt-realtime", "gpt-realtime-mini", "rtmedia-realtime", "gpt-4o-realtime-preview", "gpt-realtime-2.1")
RT_BAD_MODELS = ("", "no-such-model", "tts-1", "whisper-1", "GPT-REALTIME", "gpt-realtime ", "é" * 40, "x" * 300)
RT_TRANSCRIBERS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "rtmedia-asr")
OWN_IDS = ("rtmedia.front.initial", "rtmedia.front.update.1", "rtmedia.front.response.2")  # the front's own ids
RT_SILENCE_S = 1.0  # after a spoken turn, so that server VAD ends it
RT_LOG_GRACE_S = 0.15  # after a socket's session has ended, for the front's log of it


@dataclass(frozen=True)
class Pcm:
    """PCM a case appends, resolved (base64-encoded) when the frame is sent: a slice of real
    speech at 24 kHz, a whole spoken turn, any of `audio()`'s, or bytes that are no PCM16."""

    kind: str  # slice, turn, other
    start: float = 0.0
    length: int = 0
    odd: bool = False
    other: bytes = b""

    def pcm(self) -> bytes:
        if self.kind == "turn":
            return spoken_turn()
        if self.kind == "slice":
            return _speech_24k(self.start, self.length, self.odd)
        return self.other

    def __repr__(self) -> str:
        return f"Pcm({self.kind}, {self.start:.3f}, {self.length}, odd={self.odd}, other={len(self.other)} bytes)"


@dataclass(frozen=True)
class B64:
    """An `audio` value: `pcm` base64-encoded (how: valid, urlsafe, unpadded, with garbage, not base64)."""

    pcm: Pcm
    how: str = "valid"

    def encode(self) -> str:
        import base64

        data = self.pcm.pcm()
        text = base64.b64encode(data).decode()
        if self.how == "urlsafe":
            return base64.urlsafe_b64encode(data).decode()
        if self.how == "unpadded":
            return text.rstrip("=")
        if self.how == "spaces":
            return " ".join(text[i:i + 76] for i in range(0, len(text), 76))
        if self.how == "garbage":
            return text[: len(text) // 2] + "%%%" + text[len(text) // 2:]
        if self.how == "empty":
            return ""
        return text


def _speech_24k(start: float, length: int, odd: bool) -> bytes:
    pcm = speech_pcm(24000)
    offset = int(start * len(pcm)) // 2 * 2
    piece = pcm[offset:offset + length]
    return piece + b"\x01" if odd else piece


@functools.cache
def spoken_turn() -> bytes:
    """The test sentence at 24 kHz with silence around it: server VAD commits it, and a response follows."""
    return bytes(24000 * 2 * 3 // 10) + speech_pcm(24000) + bytes(int(24000 * 2 * RT_SILENCE_S))


@dataclass(frozen=True)
class Turn:
    """The spoken turn (spoken_turn()) as a client streams it: appends of `chunk_ms` each, sent
    `pace` times faster than real time (one append of it all is over the server's input inbox)."""

    chunk_ms: int
    pace: float

    def appends(self) -> list[str]:
        import base64

        pcm, step = spoken_turn(), 48 * self.chunk_ms  # 24 kHz PCM16: 48 bytes a millisecond
        return [json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + step]).decode()})
                for i in range(0, len(pcm), step)]


RT_TURNS = st.builds(Turn, st.sampled_from([100, 200, 200, 500]), st.sampled_from([8.0, 8.0, 4.0, 50.0]))
RT_PCM = weighted([
    st.builds(Pcm, st.just("slice"), st.floats(0, 1), st.integers(0, 96000), st.booleans()),
    st.builds(Pcm, st.just("slice"), st.floats(0, 1), st.integers(0, 96000), st.booleans()),
    st.builds(Pcm, st.just("slice"), st.floats(0, 1), st.integers(0, 96000), st.just(False)),
    st.builds(lambda data: Pcm("other", other=data), audio(max_huge=0)),
    st.builds(lambda data: Pcm("other", other=data), st.binary(min_size=1, max_size=7)),
])
RT_AUDIO = weighted([st.builds(B64, RT_PCM)] * 6 + [st.builds(B64, RT_PCM, st.sampled_from(
    ["urlsafe", "unpadded", "spaces", "garbage", "empty"]))])


def _junk() -> st.SearchStrategy[Any]:
    """Any JSON value (NaN and the infinities too: Python's json writes and reads them)."""
    return st.one_of(json_values(3), st.sampled_from([math.nan, math.inf, -math.inf, 10**30, -1, 0, "", True]))


def _often(good: st.SearchStrategy[Any], times: int = 3) -> st.SearchStrategy[Any]:
    """`good` `times` in `times + 1`, else any JSON value."""
    return weighted([good] * times + [_junk()])


def _formats() -> st.SearchStrategy[Any]:
    return _often(st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["audio/pcm", "audio/pcm", "audio/pcmu", "audio/pcma"])},
                              optional={"rate": st.sampled_from([24000, 24000, 8000, 16000, 0, "24000", 24000.0])}),
        st.sampled_from([{"type": "audio/opus"}, {"type": "audio/pcm", "rate": 24000, "channels": 1}, {},
                         "audio/pcm", "pcm16", "g711_ulaw"])))


RT_TURN_DETECTION = weighted([st.none(), st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["server_vad", "server_vad", "server_vad", "semantic_vad", "none", ""]),
    "threshold": st.one_of(st.sampled_from([0.5, 0.05, 0.95, 0.04, 0.96, 0, 1, math.nan]), floats()),
    "prefix_padding_ms": st.sampled_from([0, 300, 2000, 2001, -1, 1.5, None]),
    "silence_duration_ms": st.sampled_from([100, 200, 500, 5000, 99, 5001, 10**12, None]),
    "create_response": _often(st.booleans()),
    "interrupt_response": _often(st.booleans()),
    "idle_timeout_ms": st.sampled_from([None, 5000, 30000, 4999, 30001, 0]),
    "eagerness": st.sampled_from(["auto", "low", "medium", "high", "eager", "", None, 1]),
}), st.fixed_dictionaries({}, optional={
    "type": st.just("server_vad"), "silence_duration_ms": st.sampled_from([100, 200, 500]),
    "create_response": st.booleans()}), _junk()])
RT_TRANSCRIPTION = weighted([st.none(), st.just({}), st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.sampled_from(RT_TRANSCRIBERS), st.sampled_from(["tts-1", "", "gpt-realtime"]), _junk()),
    "language": st.sampled_from([None, "en", "en", "fr", "", "EN", "en-US"]),
    "prompt": st.sampled_from([None, "", "names: Ada", 5]),
    "delay": st.sampled_from([None, "", 1]),
    "keywords": st.sampled_from([[], ["milk"], None]),
}), _junk()])
RT_SESSION_AUDIO = st.fixed_dictionaries({}, optional={
    "input": _often(st.fixed_dictionaries({}, optional={
        "format": _formats(), "transcription": RT_TRANSCRIPTION, "turn_detection": RT_TURN_DETECTION,
        "noise_reduction": st.sampled_from([None, None, {"type": "near_field"}, "x"]),
        "no_such_field": st.just(1)})),
    "output": _often(st.fixed_dictionaries({}, optional={
        "format": _formats(), "voice": _often(st.sampled_from(["alloy", "verse", "marin", "en_US-joe-medium",
                                                               "nobody", "", {"id": "voice_1"}])),
        "speed": st.one_of(st.sampled_from([0.25, 1, 1.0, 1.5, 0.24, 1.51, 4, math.nan]), _junk())})),
})
RT_TOOLS = st.sampled_from([[], [], [{"type": "function", "name": "f", "parameters": {}}], [{"type": "mcp"}], {},
                            None])
RT_TOOL_CHOICE = st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}, "", None])
RT_MAX_TOKENS = st.one_of(st.sampled_from(["inf", "inf", 1, 3, 4096, 4097, 0, -1, 1.5, 2.0, "Inf", "4", None,
                                           math.inf, math.nan, 10**30]), _junk())
RT_MODALITIES = st.one_of(st.sampled_from([["audio"], ["text"], ["audio"], ["text", "audio"], [], ["video"],
                                           "audio", None]), _junk())
RT_SESSION_FIELDS = {
    "model": st.one_of(st.sampled_from(RT_MODELS), st.sampled_from(RT_BAD_MODELS), _junk()),
    "instructions": _often(_texts()),
    "output_modalities": RT_MODALITIES,
    "max_output_tokens": RT_MAX_TOKENS,
    "audio": _often(RT_SESSION_AUDIO, 6),
    "tools": RT_TOOLS,
    "tool_choice": RT_TOOL_CHOICE,
    "tracing": st.sampled_from([None, "auto", {"workflow_name": "x"}]),
    "truncation": st.sampled_from(["auto", "disabled", {"type": "retention_ratio"}, None]),
    "include": st.sampled_from([None, [], ["item.input_audio_transcription.logprobs"]]),
    "prompt": st.sampled_from([None, {"id": "pmpt_1"}]),
    "parallel_tool_calls": _often(st.booleans(), 1),
    "reasoning": st.sampled_from([None, {"effort": "low"}]),
    "no_such_field": _junk(),
}
RT_SESSION = weighted([
    st.builds(lambda kind, rest: {**kind, **rest},
              st.sampled_from([{"type": "realtime"}] * 4 + [{"type": "transcription"}, {}, {"type": "x"},
                                                             {"type": None}]),
              st.fixed_dictionaries({}, optional=RT_SESSION_FIELDS)),
    st.builds(lambda kind, rest: {**kind, **rest},
              st.sampled_from([{"type": "realtime"}, {"type": "transcription"}]),
              st.fixed_dictionaries({}, optional={"audio": RT_SESSION_AUDIO})),
    st.builds(lambda kind, rest: {**kind, **rest},  # few fields: most updates apply
              st.sampled_from([{"type": "realtime"}, {"type": "transcription"}]),
              st.fixed_dictionaries({}, optional={"instructions": _words(), "output_modalities":
                                                  st.sampled_from([["audio"], ["text"]]),
                                                  "max_output_tokens": st.sampled_from(["inf", 3, 50])})),
    _junk(),
])


def _ids_ref(marker: str) -> st.SearchStrategy[Any]:
    """An id: the last one the server named (the marker, resolved when sent), made up, or not a string."""
    return weighted([st.just(marker)] * 4 + [st.sampled_from(["item_nope", "resp_nope", "", "x" * 300, "🙂"]),
                                             _junk()])


def _part(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    if kind == "input_audio":
        return st.fixed_dictionaries({"type": st.just(kind)}, optional={
            "audio": weighted([RT_AUDIO] * 3 + [_junk()]), "transcript": st.one_of(st.none(), _words())})
    if kind == "output_audio":
        return st.fixed_dictionaries({"type": st.just(kind)}, optional={
            "transcript": _often(_words()), "audio": st.builds(lambda a: a, RT_AUDIO)})
    if kind == "input_image":
        return st.fixed_dictionaries({"type": st.just(kind)}, optional={
            "image_url": st.sampled_from(["data:image/png;base64,AAAA", "https://example.com/x.png", ""]),
            "detail": st.sampled_from(["auto", "low"])})
    return st.fixed_dictionaries({"type": st.just(kind)}, optional={"text": _often(_texts())})


RT_PART_KINDS = ("input_text", "input_text", "input_audio", "output_text", "text", "output_audio", "input_image",
                 "audio", "")
RT_MESSAGE = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "message", "message", "", "messages"]),
    "role": st.sampled_from(["user", "user", "user", "assistant", "assistant", "system", "", "tool", None]),
    "content": weighted([st.lists(st.sampled_from(RT_PART_KINDS).flatmap(_part), min_size=1, max_size=3)] * 4
                        + [st.just([]), _junk()]),
    "id": weighted([st.none(), st.text(max_size=12), st.just("item_mine"), st.just(ITEM_MARKER), _junk()]),
    "status": st.sampled_from(["completed", "in_progress", "x"]),
    "object": st.sampled_from(["realtime.item", "x"]),
    "no_such_field": st.just(1),
})
RT_ITEMS = weighted([
    RT_MESSAGE, RT_MESSAGE, RT_MESSAGE, RT_MESSAGE,
    st.builds(lambda role, text: {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]},
              st.just("user"), _words()),  # a valid text turn
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "mcp_call"])},
                          optional={"name": st.just("f"), "call_id": st.just("call_1"), "arguments": st.just("{}"),
                                    "output": st.just("42")}),
    _junk(),
])
RT_RESPONSE = weighted([st.none(), st.just({}), st.fixed_dictionaries({}, optional={
    "instructions": _often(_texts()),
    "max_output_tokens": RT_MAX_TOKENS,
    "output_modalities": RT_MODALITIES,
    "conversation": st.sampled_from(["auto", "auto", "none", "x", None, "", 5]),
    "metadata": st.one_of(st.sampled_from([None, {"topic": "x"}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 5}]),
                          st.dictionaries(st.text(max_size=4), st.text(max_size=4), min_size=15, max_size=18)),
    "audio": st.sampled_from([None, {"output": {"voice": "alloy"}}, {"output": {"voice": "verse"}},
                              {"output": {"format": {"type": "audio/pcm"}}}, {"output": {"format": "pcm"}},
                              {"output": {}}, {"input": {}}, "x"]),
    "input": st.sampled_from([None, [], [{"type": "item_reference", "id": "x"}]]),
    "tools": RT_TOOLS, "tool_choice": RT_TOOL_CHOICE,
    "prompt": st.sampled_from([None, {"id": "pmpt_1"}]),
    "reasoning": st.sampled_from([None, {"effort": "low"}]),
    "no_such_field": st.just(1),
}), _junk()])
RT_EVENT_IDS = weighted([st.just(UNSET)] * 4 + [st.text(max_size=12), st.sampled_from(["e1", "e1", "", "x" * 300]),
                                                st.sampled_from(OWN_IDS), _junk()])


def _event(kind: str, fields: dict[str, st.SearchStrategy[Any]] | None = None,
           optional: dict[str, st.SearchStrategy[Any]] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """A client event of type `kind` (a `kind` of None: any type), with its event_id drawn, and
    now and then a field it does not have."""
    def build(body: dict[str, Any], eid: Any, extra: Any) -> dict[str, Any]:
        event = {"type": kind, **body} if kind is not None else body
        if eid is not UNSET:
            event["event_id"] = eid
        if extra is not UNSET:
            event["no_such_field"] = extra
        return event

    return st.builds(build, st.fixed_dictionaries(fields or {}, optional=optional or {}), RT_EVENT_IDS,
                     sometimes(_junk(), 1, 12))


RT_EVENTS = [
    _event("session.update", {"session": RT_SESSION}),
    _event("session.update", {"session": RT_SESSION}),
    _event("session.update", optional={"session": _junk()}),
    _event("input_audio_buffer.append", {"audio": RT_AUDIO}),
    _event("input_audio_buffer.append", {"audio": RT_AUDIO}),
    _event("input_audio_buffer.append", {"audio": RT_AUDIO}),
    _event("input_audio_buffer.append", {"audio": RT_AUDIO}),
    _event("input_audio_buffer.append", {"audio": st.builds(B64, st.just(Pcm("turn")))}),  # over the inbox
    RT_TURNS, RT_TURNS, RT_TURNS,
    _event("input_audio_buffer.append", optional={"audio": _junk()}),
    _event("input_audio_buffer.commit"),
    _event("input_audio_buffer.clear"),
    _event("conversation.item.create", {"item": RT_ITEMS},
           {"previous_item_id": weighted([st.just(ITEM_MARKER), st.none(), st.just("root"), _junk()])}),
    _event("conversation.item.create", {"item": RT_ITEMS}),
    _event("conversation.item.truncate", optional={
        "item_id": _ids_ref(ITEM_MARKER),
        "content_index": st.sampled_from([0, 0, 0, 1, -1, "0", None]),
        "audio_end_ms": st.one_of(st.sampled_from([0, 400, 1500, -1, 10**12, 1.5, "400", True, None]),
                                  st.integers(0, 10000))}),
    _event("conversation.item.delete", optional={"item_id": _ids_ref(ITEM_MARKER)}),
    _event("conversation.item.retrieve", optional={"item_id": _ids_ref(ITEM_MARKER)}),
    _event("response.create", optional={"response": RT_RESPONSE}),
    _event("response.create", optional={"response": RT_RESPONSE}),
    _event("response.cancel", optional={"response_id": _ids_ref(RESPONSE_OPEN_MARKER)}),
    _event("output_audio_buffer.clear"),
    _event(None, {"type": st.one_of(st.sampled_from(["no.such.event", "", "session.created", "response.done",
                                                     "transcription_session.update", "session.update ",
                                                     "SESSION.UPDATE", "input_audio_buffer.append.x"]), _junk())},
           {"session": RT_SESSION}),
    _event(None, optional={"session": RT_SESSION}),  # no type at all
]


@dataclass(frozen=True)
class Raw:
    """A frame that is no event: `kind` text (malformed JSON), json (a value that is not an
    object), binary, nested (JSON nested `size` deep), event_too_large (a text frame just over
    the front's max_event_bytes) or frame_too_large (just over max_frame_bytes: the socket closes, 1009)."""

    kind: str
    text: str = ""
    data: bytes = b""
    size: int = 0
    value: Any = None

    def __repr__(self) -> str:
        shown = {"text": repr(self.text[:80]), "json": repr(self.value)[:80], "binary": f"{len(self.data)} bytes"}
        return f"Raw({self.kind}, {shown.get(self.kind, self.size)})"


RT_MALFORMED = st.one_of(
    st.sampled_from(["{not json", "", " ", "{", "}", '{"type": "session.update"', '{"type": "session.update",}',
                     "NaN", "[1, 2", '{"type": "input_audio_buffer.append", "audio": "AAAA"} trailing',
                     '{"type": "\\ud800"}', "\x00", "9" * 5000, '{"type": 1e999}', "\ufeff{}",
                     '{"type": "response.create", "type": "session.update"}']),
    st.text(max_size=60),
)
RT_RAW = weighted([
    st.builds(Raw, st.just("text"), RT_MALFORMED),
    st.builds(Raw, st.just("text"), RT_MALFORMED),
    st.builds(lambda value: Raw("json", value=value), json_values(6).filter(lambda v: not isinstance(v, dict))),
    st.builds(lambda data: Raw("binary", data=data), st.one_of(st.binary(max_size=64), st.just(
        b'{"type": "input_audio_buffer.commit"}'))),
    # Nested `size // 2` deep (an odd size: in a session.update), about Python's recursion limit
    # (1000: serve's), and far beyond it first, where shrinking goes: Hypothesis raises the limit
    # while it runs a test, and an in-process server runs under it.
    st.builds(lambda n: Raw("nested", size=n), st.sampled_from([100000, 200001, 10, 1990, 2001, 2200, 4001])),
    st.builds(lambda n: Raw("event_too_large", size=n), st.integers(1, 4096)),
])
RT_FRAMES = weighted([*RT_EVENTS, *RT_EVENTS, *[RT_RAW] * 8])  # about one frame in seven is no event
RT_FRAME_TOO_LARGE = st.builds(lambda n: Raw("frame_too_large", size=n), st.integers(1, 4096))


@dataclass(frozen=True)
class RealtimeCase:
    credential: str  # see RT_CREDENTIALS
    junk: str  # a malformed Authorization header
    query: tuple[tuple[str, str], ...]
    frames: tuple[tuple[Any, int], ...]  # (an event (a dict), a Turn or a Raw; the pause before it in ms)
    ending: str  # close (the client's close frame) or drop (the TCP connection, at once)


RT_QUERY = st.builds(
    lambda model, intent, call: tuple(kv for kv in (("model", model), ("intent", intent), ("call_id", call))
                                      if kv[1] is not UNSET),
    weighted([st.just("gpt-realtime")] * 8 + [st.sampled_from(RT_MODELS), st.sampled_from(RT_BAD_MODELS),
                                              st.just(UNSET)]),
    weighted([st.just(UNSET)] * 10 + [st.just("transcription"), st.just("transcription"),
                                      st.sampled_from(["", "conversation", "TRANSCRIPTION", "x" * 100])]),
    weighted([st.just(UNSET)] * 30 + [st.sampled_from(["rtc_nope", "", "x"])]),
)
OPENAI_REALTIME = st.builds(
    RealtimeCase,
    st.sampled_from(RT_CREDENTIALS),
    header_values(60),
    RT_QUERY,
    st.lists(st.tuples(weighted([RT_FRAMES] * 150 + [RT_FRAME_TOO_LARGE]),
                       st.sampled_from([0, 0, 0, 0, 0, 5, 20, 50, 200, 600])), max_size=12).map(tuple),
    st.sampled_from(["close", "close", "close", "drop"]),
)


def _rt_handshake(target: Target, case: RealtimeCase) -> tuple[dict[str, str], list[str] | None]:
    """The case's headers and subprotocols."""
    key = {"wrong": "wrong-key-0123456789abcdef", "wrong_protocol": "wrong-key-0123456789abcdef"}.get(
        case.credential, target.token or "any-key")
    if case.credential == "bearer":
        return {"Authorization": f"Bearer {key}"}, None
    if case.credential == "wrong":
        return {"Authorization": f"Bearer {key}"}, None
    if case.credential == "malformed":
        return ({"Authorization": case.junk} if case.junk else {}), None
    if case.credential in ("protocol", "wrong_protocol"):
        return {}, ["realtime", f"openai-insecure-api-key.{key}"]
    if case.credential == "rtmedia_protocol":
        return {}, ["realtime", f"rtmedia.bearer.{key}"]
    if case.credential == "empty_protocol":
        return {}, ["realtime", "openai-insecure-api-key."]
    return {}, None


def _rt_expected(target: Target, case: RealtimeCase) -> int:
    """The handshake's answer the case must get: 101, or the status of its refusal."""
    from rtmedia.web.openai.realtime_config import REALTIME_MODELS

    query = dict(case.query)
    if target.token and case.credential not in ("bearer", "protocol", "rtmedia_protocol"):
        return 401
    if "call_id" in query:
        return 404
    intent = query.get("intent", "")
    if intent not in ("", "transcription"):
        return 400
    if intent != "transcription" and query.get("model", "rtmedia-realtime") not in REALTIME_MODELS:
        return 404
    return 101


def _resolve(value: Any, ids: dict[str, str]) -> Any:
    """An event with its markers replaced by the ids the socket has seen, and its audio encoded."""
    if isinstance(value, dict):
        return {k: _resolve(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, ids) for v in value]
    if isinstance(value, B64):
        return value.encode()
    if isinstance(value, str) and value in ids:
        return ids[value]
    return value


def _raw_frame(target: Target, raw: Raw) -> str | bytes:
    if raw.kind == "text":
        return raw.text
    if raw.kind == "json":
        return json.dumps(raw.value)
    if raw.kind == "binary":
        return raw.data
    if raw.kind == "nested":
        half = raw.size // 2
        return '{"type": "session.update", "session": ' + "[" * half + "]" * half + "}" if raw.size % 2 else \
            "[" * half + "]" * half
    limit = target.max_event_bytes if raw.kind == "event_too_large" else target.max_frame_bytes
    head, tail = '{"type": "input_audio_buffer.append", "audio": "', '"}'
    return head + "A" * (limit + raw.size - len(head) - len(tail)) + tail


class _Socket:
    """What a Realtime case has seen on its socket, judged event by event."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.ids: dict[str, str] = {ITEM_MARKER: "", RESPONSE_OPEN_MARKER: ""}
        self.event_ids: set[str] = set()
        self.sent_ids: set[str] = set()
        self.events = 0

    def problem(self, text: str) -> None:
        if len(self.outcome.problems) < 20:
            self.outcome.problems.append(text)

    def seen(self, message: str | bytes) -> None:
        self.events += 1
        if isinstance(message, bytes):
            self.problem(f"a binary frame from the server: {message[:80]!r}")
            return
        try:
            event = json.loads(message)
        except ValueError:
            self.problem(f"a server event that is not JSON: {message[:200]!r}")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str) or not event["type"]:
            self.problem(f"a server event without a string type: {message[:200]!r}")
            return
        kind, eid = event["type"], event.get("event_id")
        if not isinstance(eid, str) or not eid:
            self.problem(f"a {kind} event without an event_id: {message[:200]!r}")
        elif eid in self.event_ids:
            self.problem(f"a {kind} event repeats the event_id {eid!r}")
        else:
            self.event_ids.add(eid)
        if kind == "error":
            self._error(event, message)
        elif kind in ("conversation.item.added", "conversation.item.done", "conversation.item.retrieved"):
            item = event.get("item")
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                self.ids[ITEM_MARKER] = item["id"]
        elif kind == "input_audio_buffer.committed" and isinstance(event.get("item_id"), str):
            self.ids[ITEM_MARKER] = event["item_id"]
        elif kind == "response.created":
            response = event.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self.ids[RESPONSE_OPEN_MARKER] = response["id"]
        elif kind == "response.done":
            response = event.get("response") if isinstance(event.get("response"), dict) else {}
            if response.get("status") == "failed":
                self.outcome.error_events["response.done/failed"] += 1
                self.problem(f"a response failed: {message[:300]}")
        elif kind == "conversation.item.input_audio_transcription.failed":
            error = event.get("error") if isinstance(event.get("error"), dict) else {}
            self.outcome.error_events[f"transcription.failed/{error.get('code')}"] += 1

    def _error(self, event: dict[str, Any], message: str) -> None:
        error = event.get("error")
        if not isinstance(error, dict) or not {"type", "code", "message", "param", "event_id"} <= error.keys() or \
                set(event) != {"type", "event_id", "error"}:
            self.problem(f"an error event not in the API's shape: {message[:300]}")
            return
        code = error["code"]
        self.outcome.error_events[str(code)] += 1
        if error["type"] == "server_error":
            self.problem(f"error event server_error ({code}): {str(error['message'])[:300]}")
        elif error["type"] != "invalid_request_error":
            self.problem(f"an error event of type {error['type']!r}: {message[:300]}")
        if not isinstance(code, str) or not code or not isinstance(error["message"], str) or not error["message"]:
            self.problem(f"an error event without a code or message: {message[:300]}")
        if error["param"] is not None and not isinstance(error["param"], str):
            self.problem(f"an error event whose param is not a string: {message[:300]}")
        ref = error["event_id"]
        if ref is not None and ref not in self.sent_ids:
            self.problem(f"an error event naming an event_id the client never sent ({str(ref)[:80]!r}): "
                         f"{message[:300]}")


def _rt_refused(outcome: Outcome, exc: Any, expected: int, case: RealtimeCase) -> None:
    status, body = exc.response.status_code, exc.response.body or b""
    parsed: Any = None
    with contextlib.suppress(ValueError):
        parsed = json.loads(body)
    reason = (parsed["error"].get("code") or parsed["error"]["type"]) if _openai_error(parsed) else ""
    outcome.status(f"HTTP {status}", str(reason))
    where = f"GET {RT_PATH}?{'&'.join(f'{k}={v[:20]}' for k, v in case.query)} ({case.credential})"
    if not _openai_error(parsed):
        outcome.problems.append(f"{where}: HTTP {status} without OpenAI's error object: {body[:300]!r}")
    if status >= 500 and (status != 503 or reason != "draining"):
        outcome.problems.append(f"{where}: HTTP {status}: {body[:300]!r}")
    elif status == 429 or status == 503:
        return  # capacity or draining: refused whatever the case was
    elif status != expected:
        outcome.problems.append(f"{where}: HTTP {status} ({reason}), expected "
                                f"{'the upgrade' if expected == 101 else expected}: {body[:300]!r}")


@door("openai_realtime", OPENAI_REALTIME, needs=["web", "openai"])
async def openai_realtime(target: Target, case: RealtimeCase) -> Outcome:
    """One `/v1/realtime` socket: the handshake, the case's frames, and the client's close (or
    its dropped connection), judged as the module docstring says and, for the events, as
    OpenAI's API has them (see _Socket)."""
    from urllib.parse import urlencode

    import websockets
    from websockets.asyncio.client import connect

    outcome = Outcome()
    headers, protocols = _rt_handshake(target, case)
    expected = _rt_expected(target, case)
    url = f"{target.web_url.replace('http', 'ws', 1)}{RT_PATH}?{urlencode(case.query)}"
    try:
        ws = await asyncio.wait_for(connect(url, additional_headers=headers, subprotocols=protocols, max_size=None,
                                            ping_interval=None, compression=None, close_timeout=CLOSE_S,
                                            open_timeout=END_S), END_S * 2)
    except websockets.InvalidStatus as exc:
        _rt_refused(outcome, exc, expected, case)
        return outcome
    except (TimeoutError, websockets.InvalidHandshake, OSError) as exc:
        outcome.status("WS handshake_failed")
        outcome.problems.append(f"the handshake failed: {type(exc).__name__}: {str(exc)[:300]}")
        return outcome
    outcome.status("WS 101")
    if expected != 101:
        outcome.problems.append(f"the handshake was answered 101, expected {expected} ({case.credential}, "
                                f"{case.query})")
    socket = _Socket(outcome)

    async def read() -> None:
        async for frame in ws:
            socket.seen(frame)

    reader = asyncio.ensure_future(read())
    try:
        await _rt_frames(target, case, ws, socket, reader, outcome)
    finally:
        if not reader.done():
            ws.transport.abort()
            reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
    # The front logs a failure of the socket's tasks after its session has ended (and, for a dropped
    # connection, after the client has gone): the case waits for that, so what it logs is its own.
    await _settled(target.sessions, target.baseline_sessions, SETTLE_S)
    await asyncio.sleep(RT_LOG_GRACE_S)
    return outcome


async def _rt_turn(ws: Any, turn: Turn) -> bool:
    """Stream a spoken turn; False: the socket closed meanwhile."""
    import websockets

    for append in turn.appends():
        try:
            await ws.send(append)
        except websockets.ConnectionClosed:
            return False
        await asyncio.sleep(turn.chunk_ms / 1000 / turn.pace)
    return True


async def _rt_frames(target: Target, case: RealtimeCase, ws: Any, socket: _Socket, reader: asyncio.Future[None],
                     outcome: Outcome) -> None:
    import websockets

    too_large = lost = False
    for frame, pause_ms in case.frames:
        if pause_ms:
            await asyncio.sleep(pause_ms / 1000)
        if reader.done():
            break
        if isinstance(frame, Turn):
            if not await _rt_turn(ws, frame):
                lost = True
                break
            continue
        if isinstance(frame, Raw):
            data = _raw_frame(target, frame)
            too_large = frame.kind == "frame_too_large"
        else:
            event = _resolve(frame, socket.ids)
            if isinstance(event.get("event_id"), str):
                socket.sent_ids.add(event["event_id"])
            data = json.dumps(event)
        try:
            await ws.send(data)
        except websockets.ConnectionClosed:
            lost = True
            break
        if too_large:
            break
    if lost and not too_large:  # the send found the socket closed: the reader sees why
        await asyncio.wait([reader], timeout=CLOSE_S)
    if too_large:  # the front reads no frame that size: it closes the socket, 1009
        done, _ = await asyncio.wait([reader], timeout=CLOSE_S)
        code = ws.protocol.close_rcvd.code if ws.protocol.close_rcvd else None
        outcome.status("WS closed", str(code))
        if not done:
            outcome.problems.append(f"the socket stayed open {CLOSE_S:g} s after a frame over max_frame_bytes")
        elif code != 1009:
            outcome.problems.append(f"a frame over max_frame_bytes closed the socket with {code}, not 1009")
        return
    if reader.done():  # the server closed the socket: no client mistake may do that
        rcvd = ws.protocol.close_rcvd
        outcome.status("WS closed", str(rcvd.code if rcvd else None))
        error = reader.exception() if not reader.cancelled() else None
        outcome.problems.append(f"the server closed the socket before the client did: "
                                f"{rcvd if rcvd else 'no close frame'}"
                                f"{f' ({type(error).__name__})' if error else ''}")
        return
    if case.ending == "drop":
        ws.transport.abort()
        outcome.status("WS dropped")
        return
    started = time.monotonic()
    await ws.close()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await asyncio.wait_for(asyncio.shield(reader), CLOSE_S)
    rcvd = ws.protocol.close_rcvd
    outcome.status("WS closed", str(rcvd.code if rcvd else None))
    if rcvd is None:
        outcome.problems.append(f"the server did not answer the client's close within "
                                f"{time.monotonic() - started:.1f} s")
    elif rcvd.code != 1000:
        outcome.problems.append(f"the server answered the client's close with {rcvd}")
    elif rcvd.reason or ws.protocol.close_rcvd_then_sent:  # its answer to a close has no reason
        outcome.problems.append(f"the server closed the socket itself ({rcvd}), not in answer to the client's close")


# ---- helpers for targets ---------------------------------------------------------------------------------

async def probe_latent_channels(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> int:
    """The VAE's latent channels, as the server states them when refusing a one-channel latent."""
    from rtmedia.v1 import video_pb2_grpc

    request = video_pb2.DecodeVideoRequest(latent=video_pb2.Tensor(shape=[1, 1, 1, 1], dtype=1, data=b"\0" * 4))
    try:
        async for _ in video_pb2_grpc.VideoServiceStub(channel).DecodeVideo(request, metadata=metadata):
            pass
    except grpc.aio.AioRpcError as exc:
        words = (exc.details() or "").split()
        if "takes" in words:
            return int(words[words.index("takes") + 1])
    return 1


async def offer_sdp() -> str:
    """A real offer like the page's (audio, video, data channel), from a peer that goes away."""
    from tests.support.webrtc import BridgePeer

    peer = BridgePeer("http://unused", video=True)
    try:
        return await peer.offer_sdp()
    finally:
        await peer.close()


def case_repr(case: Any, limit: int = 600) -> str:
    """A short description of a case (bytes and long strings abbreviated), for reports."""
    text = repr(case)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


__all__ = ["DOORS", "METHODS", "Door", "Outcome", "SdpEdit", "Target", "Verdict", "case_repr", "doors_for",
           "offer_sdp", "probe_latent_channels", "run_case"]


# ---- Twilio Media Streams (web/telephony/twilio.py) ----------------------------------------------

TWILIO_PATH = "/twilio/media"
# The door's closes: its own end (stop), and refusals that name the reason.
TWILIO_CLOSES = {1000: "the call ended", 1003: "not Twilio's messages", 1008: "out of order", 1013: "at capacity"}
TWILIO_FORMAT = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}


def _twilio_frames() -> st.SearchStrategy[str | bytes]:
    """One frame of a Media Streams socket: Twilio's messages, right or with fuzzed fields, or
    anything else."""
    sid = st.sampled_from(["MZ1", ""])
    fmt = weighted([st.just(TWILIO_FORMAT)] * 3 + [json_values()])
    start = st.builds(lambda s, f, p: {"event": "start", "streamSid": s, "start": {"streamSid": s, "mediaFormat": f,
                                                                                   "customParameters": p}},
                      sid, fmt, weighted([st.just({}), st.dictionaries(strings(12), json_values(), max_size=4)]))
    payload = weighted([st.binary(max_size=800).map(lambda b: base64.b64encode(b).decode())] * 3
                       + [strings()])
    media = st.builds(lambda s, p: {"event": "media", "streamSid": s, "media": {"track": "inbound", "payload": p}},
                      sid, payload)
    other = st.builds(lambda kind, body: {"event": kind, "streamSid": "MZ1", kind: body},
                      st.sampled_from(["mark", "dtmf", "stop", "connected", "nonsense"]),
                      weighted([st.fixed_dictionaries({"name": strings()}),
                                st.fixed_dictionaries({"digit": strings(4)}), json_values()]))
    as_json = weighted([start, media, media, media, other, json_values()]).map(json.dumps)
    return weighted([as_json] * 6 + [strings(), blobs(256)])


TWILIO_CASES = st.tuples(
    st.lists(_twilio_frames(), max_size=12).map(
        lambda frames: [json.dumps({"event": "connected"}),
                        json.dumps({"event": "start", "streamSid": "MZ1",
                                    "start": {"streamSid": "MZ1", "mediaFormat": TWILIO_FORMAT}}), *frames]),
    st.booleans())  # whether the well-formed opening comes first (else the frames alone)


@door("twilio_media", TWILIO_CASES, needs=["web", "twilio"])
async def twilio_media(target: Target, case: tuple[list[str | bytes], bool]) -> Outcome:
    """One `/twilio/media` socket: the frames, what comes back, and the client's close. The
    door may close it, with one of TWILIO_CLOSES and a reason; whatever it sends is Twilio's
    JSON (`media`, `mark`, `clear` with the call's streamSid)."""
    import aiohttp

    frames, opening = case
    frames = frames if opening else frames[2:]
    outcome = Outcome()
    url = target.web_url.replace("http", "ws", 1) + TWILIO_PATH
    try:
        async with target.http.ws_connect(url, heartbeat=None) as ws:
            outcome.status("HTTP 101")
            for frame in frames:
                if ws.closed:
                    break
                with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                    await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
            deadline = time.monotonic() + 0.5
            while not ws.closed and (left := deadline - time.monotonic()) > 0:
                try:
                    msg = await ws.receive(timeout=left)
                except TimeoutError:
                    break
                if msg.type == aiohttp.WSMsgType.TEXT:
                    event = json.loads(msg.data)
                    if event.get("event") not in ("media", "mark", "clear") or event.get("streamSid") != "MZ1":
                        outcome.problems.append(f"a message that is not Twilio's: {msg.data[:200]}")
                elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
                    break
                else:
                    outcome.problems.append(f"a {msg.type.name} frame from the door")
            server_closed = ws.closed
            await asyncio.wait_for(ws.close(), END_S)
            code = ws.close_code
        if server_closed:
            outcome.status(f"WS {code}")
            if code not in TWILIO_CLOSES:
                outcome.problems.append(f"the door closed the socket with {code}")
    except aiohttp.WSServerHandshakeError as exc:
        outcome.status(f"HTTP {exc.status}")
        if exc.status >= 500 and exc.status != 503:
            outcome.problems.append(f"the handshake got HTTP {exc.status}")
    except TimeoutError:
        outcome.problems.append(f"the socket did not close within {END_S:g} s of the client's close")
    return outcome


# ---- the SIP door (web/telephony/sip.py) -----------------------------------------------------------

SIP_METHODS = ["OPTIONS", "BYE", "CANCEL", "INFO", "REGISTER", "MESSAGE", "SUBSCRIBE", "NOTIFY", "REFER", "ACK",
               "PRACK", "UPDATE", "INVITE", "FOO"]
# An offer the door can never take (no codec it speaks), so a fuzzed INVITE never becomes a call.
UNKNOWN_CODECS_SDP = ("v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
                      "m=audio 4000 RTP/AVP 3 18\r\na=rtpmap:3 GSM/8000\r\na=rtpmap:18 G729/8000\r\n")


def _sip_requests() -> st.SearchStrategy[bytes]:
    """A SIP request, well-formed or with fuzzed lines and body, or any datagram at all."""
    header = st.tuples(weighted([st.sampled_from(["Via", "From", "To", "Call-ID", "CSeq", "Contact", "Max-Forwards",
                                                  "Content-Type", "Content-Length", "Event", "Refer-To", "X-Fuzz",
                                                  "v", "f", "t", "i", "m", "l"]), strings(16)]),
                       weighted([header_values(), strings(80)]))

    def request(method: str, uri: str, extra: list[tuple[str, str]], body: str, n: int) -> bytes:
        lines = [f"{method} {uri} SIP/2.0", f"Via: SIP/2.0/UDP 127.0.0.1:5999;branch=z9hG4bK-fuzz-{n};rport",
                 "Max-Forwards: 70", f"From: <sip:fuzz@127.0.0.1>;tag=f{n}", "To: <sip:rtmedia@127.0.0.1>",
                 f"Call-ID: fuzz-{n}", f"CSeq: 1 {method}", "Contact: <sip:fuzz@127.0.0.1:5999>",
                 *(f"{k}: {v}" for k, v in extra)]
        if method == "INVITE":  # (never a codec the door speaks: a fuzzed INVITE is never a call)
            body, extra = UNKNOWN_CODECS_SDP, [*extra, ("Content-Type", "application/sdp")]
            lines.append("Content-Type: application/sdp")
        lines.append(f"Content-Length: {len(body.encode())}")
        return ("\r\n".join(lines) + "\r\n\r\n" + body).encode("utf-8", "surrogatepass")

    well = st.builds(request, st.sampled_from(SIP_METHODS),
                     weighted([st.just("sip:rtmedia@127.0.0.1"), strings(60)]),
                     st.lists(header, max_size=4), weighted([st.just(""), strings(200)]),
                     st.integers(0, 1 << 30))
    return weighted([well] * 6 + [blobs(512), strings(300).map(lambda t: t.encode("utf-8", "surrogatepass"))])


SIP_CASES = st.lists(_sip_requests(), min_size=1, max_size=6)


@door("sip_signalling", SIP_CASES, needs=["sip"])
async def sip_signalling(target: Target, case: list[bytes]) -> Outcome:
    """Datagrams to the door's SIP port: whatever comes back is a SIP response (a status line
    with a code); no call comes of it; the door goes on (judged by run_case)."""
    import socket

    assert target.sip is not None
    outcome = Outcome()
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.bind(("127.0.0.1", 0))
        for datagram in case:
            with contextlib.suppress(OSError):
                await loop.sock_sendto(sock, datagram[:65000], ("127.0.0.1", target.sip.port))
        deadline = time.monotonic() + 0.3
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await asyncio.wait_for(loop.sock_recv(sock, 65536), left)
            except TimeoutError:
                break
            line = reply.split(b"\r\n", 1)[0]
            if not (line.startswith(b"SIP/2.0 ") and line[8:11].isdigit() and 100 <= int(line[8:11]) < 700):
                outcome.problems.append(f"a reply that is not a SIP response: {reply[:120]!r}")
                continue
            outcome.status(f"SIP {int(line[8:11])}")
            cseq = re.search(rb"\r\nCSeq:[ \t]*\d+[ \t]+(\S+)", reply)
            if line[8:11] in (b"200", b"180") and cseq is not None and cseq.group(1) == b"INVITE":
                outcome.problems.append("a fuzzed INVITE was answered as a call")
    live = await _sip_calls(target)
    if live:
        outcome.problems.append(f"{len(live)} SIP call(s) live after the case")
    return outcome


async def _sip_calls(target: Target) -> list[dict[str, Any]]:
    assert target.sip is not None
    async with target.http.get(f"{target.sip.control}/v1/sip/calls") as res:
        return [c for c in (await res.json())["calls"] if c["status"] != "ended" and c["direction"] == "inbound"]


SIP_API_CASES = st.lists(st.tuples(
    st.sampled_from(["POST /v1/sip/calls", "GET /v1/sip/calls", "GET /v1/sip/calls/{id}",
                     "POST /v1/sip/calls/{id}/hangup", "POST /v1/sip/calls/{id}/refer", "POST /v1/sip/calls/{id}/dtmf",
                     "POST /v1/sip/calls/{id}/nonsense"]),
    weighted([st.just("0123456789abcdef"), strings(40)]),
    weighted([json_values().map(json.dumps), strings(200), st.just('{"to": "sip:nobody@127.0.0.1:9"}'),
              st.fixed_dictionaries({"to": strings(60), "ring_timeout_s": json_values()}).map(json.dumps)])),
    min_size=1, max_size=5)


@door("sip_calls_api", SIP_API_CASES, needs=["sip"])
async def sip_calls_api(target: Target, case: list[tuple[str, str, str]]) -> Outcome:
    """The door's calls API: every answer below 500 in the `{"error", "reason"}` shape; a call
    it dials is hung up (through the API) by the end of the case."""
    assert target.sip is not None
    outcome = Outcome()
    for route, call_id, body in case:
        method, path = route.split(" ")
        url = target.sip.control + path.replace("{id}", quote(call_id, safe=""))
        async with target.http.request(method, url, data=body.encode("utf-8", "surrogatepass"),
                                       headers={"Content-Type": "application/json"}) as res:
            outcome.status(f"HTTP {res.status}")
            text = await res.text()
            if res.status >= 500:
                outcome.problems.append(f"{route}: HTTP {res.status}: {text[:200]}")
            elif res.status >= 400 and res.content_type == "application/json" and "error" not in json.loads(text):
                outcome.problems.append(f"{route}: an error without the error shape: {text[:200]}")
    async with target.http.get(f"{target.sip.control}/v1/sip/calls") as res:
        calls = (await res.json())["calls"]
    for call in calls:  # (a well-formed dial: end it, as a client would)
        async with target.http.post(f"{target.sip.control}/v1/sip/calls/{call['id']}/hangup") as res:
            await res.read()
    return outcome
