"""What every fuzzed door shares: the outcome a case records, the target it is sent to, the
registry (`door`, `DOORS`), and `run_case`, which judges a case (see the package docstring)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from hypothesis import strategies as st
from rtmedia.protocol.errors import error_reason
from rtmedia.v1 import video_pb2

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


def cancelling() -> bool:
    """Whether this task itself is being cancelled (not only a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def rpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
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
        if not cancelled or cancelling():
            raise
        code, reason, details = grpc.StatusCode.CANCELLED, "", "cancelled by the client"
    except grpc.aio.AioRpcError as exc:
        if lost_by_client(exc):
            outcome.status(LOST)
            return responses, LOST
        code, reason, details = rpc_status(exc)
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


async def settled(count: Callable[[], Awaitable[int]], baseline: int, within: float) -> int:
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
    leaked = await settled(target.sessions, target.baseline_sessions, settle_s)
    if leaked:
        problems.append(f"{leaked} session(s) still open {settle_s:g} s after the case")
    peers = await settled(target.web_peers, 0, settle_s) if target.web_peers is not None else 0
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
