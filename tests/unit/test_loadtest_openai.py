"""`rtmedia loadtest --transport openai-ws` without a server: the argument rules, the API
session of each profile (checked against the `openai` SDK's types and against the web
front's own session checks), the parsing of the API's events, and short runs against a
stand-in `/v1/realtime` (aiohttp on port 0) that answers turns in the API's shape; the
stand-in checks every event either way against the SDK's types."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pydantic
import pytest
from aiohttp import web
from openai.types.realtime import RealtimeClientEvent, RealtimeServerEvent
from rtmedia.clients.audio_file import write_audio
from rtmedia.clients.commands.cli import CliError
from rtmedia.clients.credentials import Credentials
from rtmedia.clients.loadtest.harness import _loadtest, check_args
from rtmedia.clients.loadtest.openai_ws import SocketPerson, api_session, append_event, socket_clips, ws_url
from rtmedia.clients.loadtest.person import Utterance
from rtmedia.clients.loadtest.run import Run
from rtmedia.clients.loadtest.settings import CONFIG_ID, input_rate, session_config
from rtmedia.clients.loadtest.speech import Clip, audio_files, load_clips
from rtmedia.server.cli import build_parser
from rtmedia.web.openai.realtime_config import RealtimeConfig

CLIENT_EVENT = pydantic.TypeAdapter(RealtimeClientEvent)
SERVER_EVENT = pydantic.TypeAdapter(RealtimeServerEvent)
RATE = 24000
DELTA_MS = 200


def parse(*argv: str):
    return build_parser().parse_args(["loadtest", *argv])


def ws(*argv: str):
    return parse("--transport", "openai-ws", *argv)


# ---- arguments -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--profile", "llm"], "--profile llm is not served over --transport openai-ws: the Realtime API cannot choose "
                           "the llm responder"),
    (["--input-rate", "16000"], "--input-rate 16000: --transport openai-ws streams audio/pcm, which is 24000 Hz"),
    (["--web-url", "ftp://host:8080"], "--web-url must be http://HOST[:PORT] or https://HOST[:PORT]"),
    (["--web-url", "http://"], "--web-url must be http://HOST[:PORT]"),
    (["--web-url", "http://host:8080/?model=x"], "--web-url must be http://HOST[:PORT]"),
    (["--web-url", "http://host:99999"], "the port is not a number 1-65535"),
    (["--tls"], "--tls, --ca, --cert and --key are for an https:// --web-url"),
    (["--sessions", "0"], "--sessions must be at least 1"),  # the transport's own rules come with the common ones
])
def test_what_openai_ws_refuses(argv, message):
    with pytest.raises(CliError, match=re.escape(message)):
        check_args(ws(*argv))


def test_transport_defaults():
    grpc_args, ws_args = parse(), ws()
    assert grpc_args.transport == "grpc" and grpc_args.web_url == "http://127.0.0.1:8080"
    assert input_rate(grpc_args) == 16000 and input_rate(ws_args) == 24000
    check_args(ws_args)
    check_args(ws("--input-rate", "24000", "--profile", "barge-in", "--web-url", "https://front.example/rt/"))
    check_args(parse("--profile", "llm"))  # llm stays served over grpc
    assert ws_url("http://127.0.0.1:8080") == "ws://127.0.0.1:8080/v1/realtime?model=gpt-realtime"
    assert ws_url("https://front.example/rt/") == "wss://front.example/rt/v1/realtime?model=gpt-realtime"


@pytest.mark.parametrize("profile", ["listen", "transcribe", "talk", "barge-in"])
def test_api_sessions_are_the_converse_sessions(profile):
    """Each profile's session.update is valid for the SDK and for the web front, and the front
    makes of it the turn detection and transcription the gRPC profile asks for."""
    args = ws("--profile", profile)
    session = api_session(profile, args)
    CLIENT_EVENT.validate_python({"type": "session.update", "event_id": CONFIG_ID, "session": session})
    assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert session["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert (session["audio"]["input"]["transcription"] is not None) == (profile != "listen")
    front = RealtimeConfig(id="sess_test", model="gpt-realtime").updated(session).to_rtmedia()
    grpc_config = session_config(profile, parse("--profile", profile))
    assert front["input_audio_format"]["sample_rate"] == 24000
    assert front["turn_detection"]["type"] == "server_vad"
    assert front["turn_detection"]["create_response"] == grpc_config["turn_detection"].get("create_response", True)


def test_no_turn_detection_is_the_api_null():
    session = api_session("listen", ws("--profile", "listen", "--turn-detection", "none"))
    assert session["audio"]["input"]["turn_detection"] is None
    assert RealtimeConfig(id="s", model="gpt-realtime").updated(session).to_rtmedia()["turn_detection"] == {
        "type": "none"}


def test_appends_are_base64_pcm_at_24k(tmp_path):
    event = json.loads(append_event(b"\x01\x00\xff\x7f"))
    CLIENT_EVENT.validate_python(event)
    assert event == {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x00\xff\x7f").decode()}
    (clip,) = socket_clips(load_clips(audio_files(write_clip(tmp_path, 16000)), 24000, 20))
    audio = [base64.b64decode(json.loads(c)["audio"]) for c in clip.chunks]
    assert {len(a) for a in audio} == {2 * 480}  # 20 ms at 24 kHz, resampled from 16 kHz
    assert clip.voice_start_ms == pytest.approx(200, abs=3)


# ---- parsing the API's events ------------------------------------------------------------------------

def person(profile: str = "talk") -> SocketPerson:
    args = ws("--profile", profile)
    clip = Clip("c", [append_event(bytes(960))] * 10, 20.0, 180.0)
    return SocketPerson(Run(args, None, [clip], 1), 0, profile)


def test_events_become_measurements():
    p = person()
    p.on_api_event(json.dumps({"type": "session.created", "event_id": "e1", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                   "silence_duration_ms": 700}}}}}), 0.0)
    assert p.admitted and p.opened.is_set() and p.silence_ms == 700
    p.sent_t = [10.0 + n * 0.02 for n in range(100)]  # chunk n (20 ms) went at 10 s + 20 ms n
    p.utterances.append(Utterance(100.0, 400.0))
    p.on_api_event(json.dumps({"type": "input_audio_buffer.speech_stopped", "event_id": "e2", "item_id": "item_1",
                               "audio_end_ms": 500}), 11.5)
    p.on_api_event(json.dumps({"type": "conversation.item.input_audio_transcription.completed", "event_id": "e3",
                               "item_id": "item_1", "content_index": 0, "transcript": "hi"}), 11.55)
    p.on_api_event(json.dumps({"type": "response.created", "event_id": "e4",
                               "response": {"id": "resp_1", "status": "in_progress"}}), 11.6)
    delta = base64.b64encode(bytes(2 * 4800)).decode()  # 200 ms
    for n, t in enumerate((11.7, 11.8, 12.2)):  # the third comes after the first two have played: an underrun
        p.on_api_event(json.dumps({"type": "response.output_audio.delta", "event_id": f"d{n}", "response_id": "resp_1",
                                   "item_id": "item_9", "output_index": 0, "content_index": 0, "delta": delta}), t)
    p.on_api_event(json.dumps({"type": "response.done", "event_id": "e5",
                               "response": {"id": "resp_1", "status": "completed"}}), 12.3)
    samples = p.stats.samples
    assert [v for _, v in samples["response_latency_ms"]] == pytest.approx([200.0])
    assert [v for _, v in samples["transcript_final_ms"]] == pytest.approx([50.0])
    assert [v for _, v in samples["voice_to_voice_ms"]] == pytest.approx([1300.0])  # from chunk 20's send
    (reply,) = p.live_replies
    assert reply.item_id == "item_9" and reply.status == "done" and reply.received_ms == 600
    assert p.underruns == 1 and p.errors == 0


def test_errors_and_malformed_events():
    p = person()
    p.on_api_event("not json", 1.0)
    p.on_api_event(json.dumps({"type": "response.output_audio.delta", "event_id": "e"}), 1.0)
    p.on_api_event(json.dumps({"type": "response.output_audio.delta", "response_id": "r", "delta": "%%%"}), 1.0)
    p.on_api_event(json.dumps({"type": "response.done", "response": {"id": "r", "status": "failed"}}), 1.0)
    p.on_api_event(json.dumps({"type": "error", "event_id": "e", "error": {
        "type": "invalid_request_error", "code": "input_backpressure", "message": "m", "event_id": None}}), 1.0)
    p.on_api_event(json.dumps({"type": "rate_limits.updated", "rate_limits": []}), 1.0)  # not measured: ignored
    assert dict(p.stats.errors) == {"malformed:?": 1, "malformed:response.output_audio.delta": 2,
                                    "response_failed": 1, "input_backpressure": 1}
    assert not p.run.failure
    p.on_api_event(json.dumps({"type": "error", "event_id": "e", "error": {
        "type": "invalid_request_error", "code": "unknown_parameter", "message": "unknown parameter session.x",
        "event_id": CONFIG_ID}}), 1.0)
    assert p.run.failure == "the server rejected the session config: unknown parameter session.x"


def test_a_session_event_without_turn_detection_still_admits():
    p = person()
    p.on_api_event(json.dumps({"type": "session.created", "session": {"type": "realtime"}}), 0.0)
    assert p.admitted and p.silence_ms == 500


# ---- runs against a stand-in /v1/realtime ---------------------------------------------------------------

class Conversation:
    """One socket of the stand-in: an energy VAD over the appends (speech_started at the
    first loud chunk, speech_stopped after `silence_ms` of quiet), a transcript where the
    session asked for one, and a reply of `reply_ms` in 200 ms deltas sent up to one second
    ahead of real time, which speech cancels (response.done cancelled; the API sends no
    output_audio_buffer.cleared on a WebSocket)."""

    def __init__(self, stand_in: StandIn, ws: web.WebSocketResponse) -> None:
        self.stand_in, self.ws = stand_in, ws
        self.ids = itertools.count(1)
        self.pos_ms = 0.0
        self.speaking = False
        self.quiet_ms = 0.0
        self.voiced_end_ms = 0.0
        self.item_id = ""
        self.transcribe = False
        self.reply: asyncio.Task[None] | None = None

    async def send(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "event_id": f"event_{next(self.ids)}", **fields}
        SERVER_EVENT.validate_python(event)
        await self.ws.send_str(json.dumps(event))

    def session(self) -> dict[str, Any]:
        return {"type": "realtime", "audio": {"input": {"turn_detection": {
            "type": "server_vad", "silence_duration_ms": self.stand_in.silence_ms}}}}

    async def run(self) -> None:
        await self.send("session.created", session=self.session())
        try:
            async for msg in self.ws:
                event = json.loads(msg.data)
                CLIENT_EVENT.validate_python(event)
                self.stand_in.received.append(event)
                await self.on(event)
        finally:
            if self.reply is not None:
                self.reply.cancel()
                await asyncio.gather(self.reply, return_exceptions=True)
            self.stand_in.closed += 1

    async def on(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "session.update":
            self.transcribe = event["session"]["audio"]["input"].get("transcription") is not None
            await self.send("session.updated", session=self.session())
            if self.stand_in.close_with:  # the server ends the session (as rtmedia's front does, naming why)
                await self.ws.close(message=self.stand_in.close_with.encode())
        elif kind == "input_audio_buffer.append":
            await self.on_audio(np.frombuffer(base64.b64decode(event["audio"]), "<i2"))
        elif kind == "conversation.item.truncate":
            await self.send("conversation.item.truncated", item_id=event["item_id"], content_index=0,
                            audio_end_ms=event["audio_end_ms"])

    async def on_audio(self, samples: np.ndarray) -> None:
        chunk_ms = len(samples) * 1000 / RATE
        loud = bool(np.abs(samples.astype(np.int32)).max() > 1000)
        if loud and not self.speaking:
            self.speaking, self.item_id = True, f"item_in_{next(self.ids)}"
            await self.send("input_audio_buffer.speech_started", item_id=self.item_id, audio_start_ms=int(self.pos_ms))
            if self.reply is not None and not self.reply.done():  # a barge-in
                self.reply.cancel()
                await asyncio.gather(self.reply, return_exceptions=True)
                await self.send("response.done", response={"id": self.stand_in.replies[-1], "object": "realtime.response",
                                                           "status": "cancelled", "output": []})
        if loud:
            self.quiet_ms, self.voiced_end_ms = 0.0, self.pos_ms + chunk_ms
        elif self.speaking:
            self.quiet_ms += chunk_ms
            if self.quiet_ms >= self.stand_in.silence_ms:
                self.speaking = False
                await self.send("input_audio_buffer.speech_stopped", item_id=self.item_id,
                                audio_end_ms=int(self.voiced_end_ms))
                await self.send("input_audio_buffer.committed", item_id=self.item_id, previous_item_id=None)
                if self.transcribe:
                    await self.send("conversation.item.input_audio_transcription.completed", item_id=self.item_id,
                                    content_index=0, transcript="hello there",
                                    usage={"type": "duration", "seconds": 1.0})
                self.reply = asyncio.create_task(self.answer())
        self.pos_ms += chunk_ms

    async def answer(self) -> None:
        n = next(self.ids)
        rid, item = f"resp_{n}", f"item_out_{n}"
        self.stand_in.replies.append(rid)
        self.stand_in.items[rid] = item
        await self.send("response.created", response={"id": rid, "object": "realtime.response", "status": "in_progress",
                                                      "output": []})
        loop = asyncio.get_running_loop()
        start = loop.time()
        delta = base64.b64encode(bytes(2 * RATE * DELTA_MS // 1000)).decode()
        for k in range(self.stand_in.reply_ms // DELTA_MS):
            await asyncio.sleep(max(0.0, start + k * DELTA_MS / 1000 - 1.0 - loop.time()))
            await self.send("response.output_audio.delta", response_id=rid, item_id=item, output_index=0,
                            content_index=0, delta=delta)
        await self.send("response.done", response={"id": rid, "object": "realtime.response", "status": "completed",
                                                   "output": []})


class StandIn:
    """`/v1/realtime` for these tests: a plain GET is refused as the web front refuses it
    (400, no Upgrade); `refuse_all` answers every request with that status, `refuse_upgrade`
    every handshake; `close_with` closes each socket with that message once it is set up."""

    def __init__(self, reply_ms: int = 600, silence_ms: int = 300, refuse_upgrade: int | None = None,
                 refuse_all: int | None = None, close_with: str = "") -> None:
        self.reply_ms, self.silence_ms, self.close_with = reply_ms, silence_ms, close_with
        self.refuse_upgrade, self.refuse_all = refuse_upgrade, refuse_all
        self.received: list[dict[str, Any]] = []
        self.replies: list[str] = []
        self.items: dict[str, str] = {}
        self.handshakes: list[dict[str, str]] = []
        self.closed = 0

    @staticmethod
    def refusal(status: int, code: str) -> web.Response:
        return web.json_response({"error": {"message": code, "type": "invalid_request_error", "param": None,
                                            "code": code}}, status=status)

    async def realtime(self, request: web.Request) -> web.StreamResponse:
        if self.refuse_all:
            return self.refusal(self.refuse_all, "invalid_api_key")
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return self.refusal(400, "websocket_required")
        self.handshakes.append({"model": request.query.get("model", ""),
                                "authorization": request.headers.get("Authorization", "")})
        if self.refuse_upgrade:
            return self.refusal(self.refuse_upgrade, "rate_limit_exceeded")
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await Conversation(self, ws).run()
        return ws


@asynccontextmanager
async def serving(stand_in: StandIn, route: bool = True) -> AsyncIterator[str]:
    app = web.Application()
    if route:
        app.router.add_get("/v1/realtime", stand_in.realtime)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def write_clip(folder, rate: int = RATE):
    """0.2 s of silence, 0.6 s of a loud tone, 0.2 s of silence."""
    tone = (np.sin(np.arange(int(rate * 0.6)) * 2 * np.pi * 300 / rate) * 8000).astype(np.int16)
    quiet = np.zeros(rate // 5, np.int16)
    write_audio(folder / "tone.wav", np.concatenate([quiet, tone, quiet]).tobytes(), rate)
    return folder


def clips(folder) -> list[Clip]:
    return socket_clips(load_clips(audio_files(write_clip(folder)), RATE, 20))


async def test_a_talk_run_measures_what_grpc_measures(tmp_path):
    stand_in = StandIn()
    async with serving(stand_in) as url:
        args = ws("--web-url", url, "--sessions", "2", "--duration", "2.5", "--quiet", "--profile", "talk")
        report = await _loadtest(args, clips(tmp_path), Credentials(token="tok-1"))
    assert report["transport"] == "openai-ws"
    assert report["target"] == url.replace("http", "ws") + "/v1/realtime?model=gpt-realtime"
    assert report["input_rate"] == 24000
    assert report["sessions_started"] == report["sessions_completed"] == 2 and report["errors"] == 0, report
    assert stand_in.closed == 2
    assert stand_in.handshakes == [{"model": "gpt-realtime", "authorization": "Bearer tok-1"}] * 2
    assert report["responses"] >= 2 and report["underruns"] == 0
    for metric in ("response_latency_ms", "voice_to_voice_ms", "vad_start_ms", "transcript_final_ms"):
        assert report[metric]["count"] >= 2, metric
    assert report["response_latency_ms"]["p95"] < 300  # the stand-in answers at once
    assert report["slo"]["held"], report["slo"]
    kinds = {e["type"] for e in stand_in.received}
    assert kinds == {"session.update", "input_audio_buffer.append"}  # no acks, nothing rtmedia-only
    update = next(e for e in stand_in.received if e["type"] == "session.update")
    assert update["event_id"] == CONFIG_ID and update["session"] == api_session("talk", args)


async def test_a_barge_in_truncates_what_was_played(tmp_path):
    stand_in = StandIn(reply_ms=3000)
    async with serving(stand_in) as url:
        args = ws("--web-url", url, "--sessions", "1", "--duration", "3", "--quiet", "--profile", "barge-in",
                  "--barge-in-share", "1", "--seed", "3")
        report = await _loadtest(args, clips(tmp_path), Credentials())
    truncates = [e for e in stand_in.received if e["type"] == "conversation.item.truncate"]
    assert truncates, report
    first = truncates[0]
    assert first["item_id"] == stand_in.items[stand_in.replies[0]] and first["content_index"] == 0
    assert 300 <= first["audio_end_ms"] <= 1100  # it interrupts 0.4-0.9 s into the reply
    assert report["barge_in_ms"]["count"] == len(truncates)
    assert report["errors"] == 0 and report["sessions_completed"] == 1, report
    assert stand_in.handshakes[0]["authorization"] == ""  # no token, no header


async def test_refused_handshakes_count_as_rejected(tmp_path):
    async with serving(StandIn(refuse_upgrade=429)) as url:
        report = await _loadtest(ws("--web-url", url, "--sessions", "2", "--duration", "1", "--quiet"),
                                 clips(tmp_path), Credentials())
    assert report["sessions_rejected"] == 2 and report["errors"] == 0
    assert not report["slo"]["held"] and "2 sessions rejected" in report["slo"]["verdict"]


async def test_a_socket_the_server_closes_is_an_error_named_by_its_reason(tmp_path):
    async with serving(StandIn(close_with="idle_timeout")) as url:
        report = await _loadtest(ws("--web-url", url, "--sessions", "1", "--duration", "1.5", "--quiet"),
                                 clips(tmp_path), Credentials())
    assert report["errors_by_code"] == {"closed:idle_timeout": 1}
    assert report["sessions_started"] == 1 and report["sessions_completed"] == 0
    assert report["per_session"][0]["closed_reason"] == "idle_timeout"


@pytest.mark.parametrize(("stand_in", "route", "token", "message"), [
    (StandIn(refuse_all=401), True, None, "the web front wants a token (401): give --token or set RTMEDIA_TOKEN"),
    (StandIn(refuse_all=401), True, "bad", "the web front refused the token (401): invalid_api_key"),
    (StandIn(), False, None, "does not serve /v1/realtime (404)"),
    (StandIn(refuse_all=503), True, None, "answered 503: invalid_api_key"),
])
async def test_a_front_that_cannot_serve_the_run_is_one_line(tmp_path, stand_in, route, token, message):
    async with serving(stand_in, route) as url:
        with pytest.raises(CliError, match=re.escape(message)):
            await _loadtest(ws("--web-url", url, "--duration", "1", "--quiet"), clips(tmp_path),
                            Credentials(token=token))
    assert not stand_in.handshakes


async def test_nothing_listening_is_one_line(tmp_path):
    with pytest.raises(CliError, match=r"cannot reach http://127\.0\.0\.1:9: .*--web"):
        await _loadtest(ws("--web-url", "http://127.0.0.1:9", "--duration", "1", "--quiet", "--connect-timeout", "2"),
                        clips(tmp_path), Credentials())


async def test_a_token_goes_in_plaintext_only_to_this_machine(tmp_path):
    with pytest.raises(CliError, match=r"refusing to send a token in plaintext to front\.example"):
        await _loadtest(ws("--web-url", "http://front.example:8080", "--duration", "1", "--quiet"),
                        clips(tmp_path), Credentials(token="tok"))
