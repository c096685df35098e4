"""`rtmedia loadtest --transport openai-ws`: the simulated person of rtmedia.clients.loadtest.person
speaking OpenAI's Realtime API (GA) to the web front's `/v1/realtime` WebSocket, as any client
written for that API would, so that the two doors are measured by the same code.

What differs from a Converse stream, and why:

- The session is set with the API's `session.update` (audio/pcm, PCM16 at 24 kHz, both ways;
  server_vad or no turn detection; transcription where the profile transcribes). The speech is
  resampled to 24 kHz and each chunk is encoded once, as the JSON text of its
  `input_audio_buffer.append`, so the load generator spends its CPU on sessions, not encoding.
- There is no `playback.ack` in the API: the client only plays its replies, and the server
  estimates the playback from the wall clock since a reply's first delta.
- A barge-in is the API's client duty: when `speech_started` comes while a reply plays, the
  client stops that reply and sends `conversation.item.truncate` with what it played (before
  its next audio chunk: control before media). The reply also stops at the server's
  `output_audio_buffer.cleared` or its cancelled `response.done`, whichever comes first.
- Replies come from the server's default responder: the API has no per-session responder.
- A session ends when the client closes the socket (the API has no `session.close`): it
  completed when the close handshake did; a socket the server closed first is an error named
  by the close message (its `session.closed` reason, e.g. `closed:idle_timeout`).
- Admission is the handshake: a 429 (at `max_sessions`, or over a token's quota) counts as
  rejected, a 401 stops the run, any other refusal is an `http:STATUS` error.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import json
import ssl
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import WSMsgType
from rtmedia.clients.commands.common import CliError
from rtmedia.clients.credentials import TOKEN_ENV, Credentials
from rtmedia.clients.loadtest.person import Person, Reply
from rtmedia.clients.loadtest.settings import API_INPUT_RATE, CLOSE_WAIT_S, CONFIG_ID
from rtmedia.clients.loadtest.speech import Clip
from rtmedia.protocol.tokens import is_loopback
from rtmedia.protocol.turn_kinds import NONE, SEMANTIC_VAD

if TYPE_CHECKING:
    from rtmedia.clients.loadtest.run import Run

MODEL = "gpt-realtime"
PATH = "/v1/realtime"
OUTPUT_RATE = 24000  # audio/pcm
TRANSCRIPTION = {"model": "whisper-1"}
SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
MAX_EVENT_BYTES = 8 * 1024 * 1024
READER_WAIT_S = 2.0  # for the reader to see the end of a socket that failed a send
# The profiles that need what the API cannot ask for, with why.
REFUSED_PROFILES = {
    "llm": "the Realtime API cannot choose the llm responder per session (replies come from the server's default "
           "responder: run the server with --responder llm and use --profile talk)",
}


# ---- arguments ---------------------------------------------------------------------------------------

def check_openai_args(args: argparse.Namespace) -> None:
    """What --transport openai-ws cannot do, as one-line errors."""
    if args.profile in REFUSED_PROFILES:
        raise CliError(f"--profile {args.profile} is not served over --transport openai-ws: "
                       f"{REFUSED_PROFILES[args.profile]}")
    if args.input_rate is not None and args.input_rate != API_INPUT_RATE:
        raise CliError(f"--input-rate {args.input_rate}: --transport openai-ws streams audio/pcm, which is "
                       f"{API_INPUT_RATE} Hz (leave --input-rate out)")
    url = urlsplit(args.web_url)
    if url.scheme not in SCHEMES or not url.hostname or url.query or url.fragment:
        raise CliError(f"--web-url must be http://HOST[:PORT] or https://HOST[:PORT] (a path prefix is allowed), "
                       f"got {args.web_url!r}")
    try:
        url.port  # noqa: B018 (a port out of range raises here)
    except ValueError:
        raise CliError(f"--web-url {args.web_url!r}: the port is not a number 1-65535") from None
    secure = SCHEMES[url.scheme] == "wss"
    if not secure and (getattr(args, "tls", False) or args.ca or args.cert):
        raise CliError("--tls, --ca, --cert and --key are for an https:// --web-url with --transport openai-ws")


def ws_url(web_url: str) -> str:
    """The Realtime API's WebSocket URL under the web front's base URL."""
    url = urlsplit(web_url)
    return f"{SCHEMES[url.scheme]}://{url.netloc}{url.path.rstrip('/')}{PATH}?model={MODEL}"


def api_session(profile: str, args: argparse.Namespace) -> dict[str, Any]:
    """The API's session object (session.update's `session`) for a profile: what
    rtmedia.clients.loadtest.settings.session_config asks of a Converse session, in the API's terms."""
    turn: dict[str, Any] | None = None
    if args.turn_detection != NONE:
        turn = {"type": args.turn_detection}
        if args.turn_detection == SEMANTIC_VAD:
            turn["eagerness"] = args.eagerness or "auto"
        if args.interruption:
            turn["interruption"] = {"mode": args.interruption}  # an rtmedia extension
        if args.preemptive is not None:
            turn["preemptive"] = args.preemptive == "on"  # an rtmedia extension
        if profile in ("listen", "transcribe"):
            turn["create_response"] = False
    pcm = {"type": "audio/pcm", "rate": API_INPUT_RATE}
    return {"type": "realtime",
            "audio": {"input": {"format": pcm, "turn_detection": turn,
                                "transcription": dict(TRANSCRIPTION) if profile != "listen" else None},
                      "output": {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE}}}}


def append_event(pcm16: bytes) -> str:
    """`input_audio_buffer.append` of PCM16 at 24 kHz, as the JSON text frame sent."""
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode("ascii")},
                      separators=(",", ":"))


def socket_clips(clips: list[Clip]) -> list[Clip]:
    """The clips (loaded at 24 kHz) with each chunk as its append event's JSON text."""
    return [dataclasses.replace(c, chunks=[append_event(m.input_audio_buffer_append.audio) for m in c.chunks])
            for c in clips]


# ---- the connection ------------------------------------------------------------------------------------

@dataclass
class SocketLink:
    """What every session of a run connects with: one aiohttp session (no connection limit:
    each WebSocket holds its own connection), the URL, the token header and TLS."""

    url: str
    http: aiohttp.ClientSession
    headers: dict[str, str]
    ssl: ssl.SSLContext | bool
    handshake_timeout: float

    async def connect(self) -> aiohttp.ClientWebSocketResponse:
        return await asyncio.wait_for(self.http.ws_connect(
            self.url, headers=self.headers, ssl=self.ssl, max_msg_size=MAX_EVENT_BYTES, compress=0,
            timeout=aiohttp.ClientWSTimeout(ws_close=CLOSE_WAIT_S)), self.handshake_timeout)

    async def close(self) -> None:
        await self.http.close()


def _ssl_context(args: argparse.Namespace, credentials: Credentials) -> ssl.SSLContext | bool:
    if urlsplit(args.web_url).scheme not in ("https", "wss"):
        return True  # aiohttp's default; a ws:// URL uses no TLS
    roots = credentials.root_certificates
    context = ssl.create_default_context(cadata=roots.decode("ascii") if roots else None)
    if args.cert is not None:
        context.load_cert_chain(args.cert, args.key)
    return context


def _api_message(body: str) -> str:
    """The message of an OpenAI error body, else the start of the body."""
    try:
        error = json.loads(body).get("error") or {}
        return str(error.get("message") or "")[:200]
    except (ValueError, AttributeError):
        return body.strip().splitlines()[0][:200] if body.strip() else ""


async def open_link(args: argparse.Namespace, credentials: Credentials) -> SocketLink:
    """A SocketLink to a web front that serves /v1/realtime (a plain GET of it must be refused
    for want of an Upgrade, not be a 404 or a 401); one-line errors otherwise."""
    host = urlsplit(args.web_url).hostname or ""
    secure = urlsplit(args.web_url).scheme in ("https", "wss")
    if credentials.token and not secure and not is_loopback(host):
        raise CliError(f"refusing to send a token in plaintext to {host}; use an https:// --web-url")
    headers = {"Authorization": f"Bearer {credentials.token}"} if credentials.token else {}
    context = _ssl_context(args, credentials)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=args.connect_timeout))
    link = SocketLink(ws_url(args.web_url), http, headers, context, max(args.connect_timeout, args.reply_timeout))
    probe = link.url.replace("ws", "http", 1)
    try:
        async with http.get(probe, headers=headers, ssl=context,
                            timeout=aiohttp.ClientTimeout(total=args.connect_timeout)) as response:
            status, said = response.status, _api_message(await response.text())
    except TimeoutError:
        await http.close()
        raise CliError(f"cannot reach {args.web_url}: no answer within {args.connect_timeout:g} s") from None
    except (aiohttp.ClientError, OSError) as exc:
        await http.close()
        said = exc.os_error.strerror or str(exc.os_error) if isinstance(exc, aiohttp.ClientConnectorError) else exc
        raise CliError(f"cannot reach {args.web_url}: {str(said) or type(exc).__name__}; check --web-url and that "
                       "the server runs with --web (or `rtmedia web` runs)") from None
    problem = ""
    if status == 401:
        problem = (f"the web front refused the token (401): {said}" if credentials.token else
                   f"the web front wants a token (401): give --token or set {TOKEN_ENV}")
    elif status == 404:
        problem = (f"{args.web_url} does not serve {PATH} (404): no Realtime API on this web front, or it runs "
                   "with --no-openai-api")
    elif status >= 500:
        problem = f"{probe} answered {status}" + (f": {said}" if said else "")
    if problem:
        await http.close()
        raise CliError(problem)
    return link


# ---- one simulated person on the WebSocket ------------------------------------------------------------

class SocketPerson(Person):
    """rtmedia.clients.loadtest.person.Person on `/v1/realtime`: the sender writes the API's text
    frames (control events first), the reader turns the API's events into Person's calls."""

    def __init__(self, run: Run, index: int, profile: str) -> None:
        super().__init__(run, index, profile)
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.control: list[str] = []  # events the reader asked for, sent before the next chunk
        self.closing = False  # the client closed the socket

    # ---- lifecycle -------------------------------------------------------------------------------
    SENDER_ENDED = (aiohttp.ClientError, ConnectionError)

    async def end(self, reader: asyncio.Task[None]) -> None:
        await self.close()

    async def stop_reader(self, reader: asyncio.Task[None]) -> None:
        if not reader.done():  # a socket that ended under the sender: its reader says how
            await asyncio.wait([reader], timeout=READER_WAIT_S)
        if not reader.done():
            self.cancelled = True
            reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        if self.ws is not None and not self.ws.closed:
            self.closing = True
            await asyncio.gather(asyncio.wait_for(self.ws.close(), CLOSE_WAIT_S), return_exceptions=True)

    async def open(self) -> bool:
        """The handshake; False when it was refused (and counted as such)."""
        try:
            self.ws = await self.run.link.connect()
            return True
        except aiohttp.WSServerHandshakeError as exc:
            self.refused(exc.status)
        except TimeoutError:
            self.error("connect_timeout")
        except (aiohttp.ClientError, OSError) as exc:
            self.error(f"connect:{type(exc).__name__}")
        return False

    def refused(self, status: int) -> None:
        if status == 429:
            self.stats.rejected += 1  # at max_sessions or over the token's quota
        elif status == 401:  # so would every other session be: stop
            token = bool(self.run.link.headers)
            self.run.fail("the web front refused the token (401)" if token else
                          f"the web front wants a token (401): give --token or set {TOKEN_ENV}")
        else:
            self.error(f"http:{status}")

    async def close(self) -> None:
        """The client's end of the session: the close handshake, then the reader's end."""
        assert self.ws is not None
        self.closing = True
        await asyncio.wait_for(self.ws.close(), CLOSE_WAIT_S)
        if self.ws.close_code == aiohttp.WSCloseCode.OK:
            self.closed_reason = "client"
            self.stats.completed += 1
        else:
            self.error(f"closed:code_{self.ws.close_code}")

    async def read(self) -> None:
        assert self.ws is not None
        try:
            while True:
                msg = await self.ws.receive()
                if msg.type is WSMsgType.TEXT:
                    self.on_api_event(msg.data, time.perf_counter())
                elif msg.type is WSMsgType.BINARY:
                    self.error("binary_frame")
                else:
                    break
            if not self.closing:  # the server ended the session
                self.closed_reason = (msg.extra if msg.type is WSMsgType.CLOSE and msg.extra else
                                      f"code_{self.ws.close_code}")
                self.error(f"closed:{self.closed_reason}")
        finally:
            self.ended = True
            self.opened.set()

    # ---- what this transport sends -----------------------------------------------------------------
    async def send(self, msg: Any) -> None:
        assert self.ws is not None
        while self.control:
            await self.ws.send_str(self.control.pop(0))
        await self.ws.send_str(msg)

    def config_event(self) -> Any:
        return json.dumps({"type": "session.update", "event_id": CONFIG_ID, "session": self.run.configs[self.profile]},
                          separators=(",", ":"))

    async def send_ack(self, reply: Reply, played_ms: int) -> None:
        """The API has no playback.ack: the server estimates playback from the wall clock."""

    # ---- the API's server events -------------------------------------------------------------------
    def on_api_event(self, text: str, now: float) -> None:
        """One server event (a JSON text frame), as Person's calls; a malformed one is an error."""
        kind = "?"
        try:
            event = json.loads(text)
            kind = str(event.get("type"))
            self.on_api(kind, event, now)
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
            self.error(f"malformed:{kind}")

    def on_api(self, kind: str, event: dict[str, Any], now: float) -> None:
        if kind == "response.output_audio.delta":
            audio = base64.b64decode(event["delta"], validate=True)
            reply = self.on_audio(event["response_id"], len(audio) // 2, OUTPUT_RATE, now)
            if reply is not None and not reply.item_id:
                reply.item_id = event.get("item_id") or ""
        elif kind == "input_audio_buffer.speech_started":
            self.on_judged(now)
            self.on_speech_started(event["audio_start_ms"], now)
            self.cut_playback(now)
        elif kind == "input_audio_buffer.speech_tentative":  # rtmedia's confirmed interruptions
            self.on_tentative(event["response_id"], now)
        elif kind == "input_audio_buffer.backchannel":
            self.on_judged(now)
        elif kind == "input_audio_buffer.speech_stopped":
            self.on_speech_stopped(event["item_id"], event["audio_end_ms"], now)
        elif kind == "input_audio_buffer.committed":
            if self.trigger is None:  # a commit with no speech_stopped before it ends the turn here
                self.trigger = (now, None)
        elif kind == "conversation.item.input_audio_transcription.completed":
            self.on_transcript(event["item_id"], now)
        elif kind == "response.created":
            self.on_response_created(event["response"]["id"], now)
        elif kind == "response.done":
            response = event["response"]
            self.stats.record_timings(response.get("timings") or {})
            if response.get("status") == "cancelled":
                self.on_cleared(response["id"], now)
            self.on_response_done(response["id"], response.get("status") in ("completed", "cancelled"))
        elif kind == "output_audio_buffer.cleared":
            self.on_cleared(event["response_id"], now)
        elif kind == "error":
            error = event.get("error") or {}
            self.on_error(str(error.get("code") or error.get("type") or "error"), str(error.get("message") or ""),
                          str(error.get("event_id") or ""))
        elif kind in ("session.created", "session.updated"):
            self.on_session(_silence_ms(event))

    def cut_playback(self, now: float) -> None:
        """The user spoke over a reply: stop playing it and tell the server what was heard."""
        for reply in list(self.live_replies):
            if reply.first_audio_t is None or reply.cleared or not (reply.playing(now) or not reply.status):
                continue
            played = reply.played_ms(now)
            if self.on_cleared(reply.response_id, now) is not None and reply.item_id:
                self.control.append(json.dumps({"type": "conversation.item.truncate", "item_id": reply.item_id,
                                                "content_index": 0, "audio_end_ms": played}, separators=(",", ":")))


def _silence_ms(event: dict[str, Any]) -> int:
    """A session event's server_vad silence window (0: none said); never fails, as the
    session's admission hangs on it."""
    try:
        turn = event["session"]["audio"]["input"].get("turn_detection") or {}
        return int(turn.get("silence_duration_ms") or 0)
    except (KeyError, TypeError, AttributeError, ValueError):
        return 0
