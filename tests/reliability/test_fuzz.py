"""Every door of the server fuzzed (tests/reliability/doors/), a few Hypothesis cases each, on
an in-process server with tokens on and the Riva API served, and a bridge beside it as `serve
--web` runs one. A well-behaved session with the right token talks all along.

Each door's test proves, for every case Hypothesis draws (derandomised: the same cases on every
run): the call ends with a clear status (never UNKNOWN or INTERNAL; an ErrorInfo reason
whenever rtmedia ends it) or error events on a stream that stays open (never `server_error`);
a stream ends once its client closes it; the server's sessions and the bridge's peers return to
their baseline; the server still answers health and logged no error; a call without a valid
token is refused and one with it is not. The last test proves the well-behaved session kept
completing its turns throughout. The long run is tests/reliability/fuzz.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig
from rtmedia.v1 import speech_pb2
from rtmedia.web.bridge import Bridge, BridgeConfig
from rtmedia.web.openai.openai_api import OpenAIConfig
from rtmedia.web.openai.realtime_ws import RealtimeLimits
from rtmedia.web.telephony.twilio import TwilioConfig
from yarl import URL

from tests.reliability.doors import (
    DOORS,
    METHODS,
    SipTarget,
    Target,
    case_repr,
    offer_sdp,
    probe_latent_channels,
    run_case,
)
from tests.reliability.talker import Talker
from tests.support.waits import until

GOOD = "fuzz-good-token-0123456789"
LIMITED = "fuzz-limited-token-0123456789"
# Cases per door: the doors whose cases are cheap get more.
EXAMPLES = {"converse": 40, "raw_bytes": 40, "flood": 6, "oversize": 10, "auth": 15, "web_offer": 25,
            "web_whip": 20, "web_routes": 30, "openai_speech": 30, "openai_transcription": 30, "openai_realtime": 15}
DEFAULT_EXAMPLES = 25
UPLOAD_LIMIT = 256 * 1024  # the web front's upload bound here: an oversize case stays cheap
# The Realtime sockets' frame limits here: oversize frames stay cheap (a spoken turn, ~350 KB, still fits).
REALTIME_LIMITS = RealtimeLimits(max_event_bytes=512 * 1024, max_frame_bytes=1024 * 1024)
FUZZ = {"deadline": None, "derandomize": True, "database": None, "suppress_health_check": list(HealthCheck)}


class ErrorLog(logging.Handler):
    """Every record at ERROR or above, from any logger (the server, the bridge, asyncio)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}" + (" (with a traceback)" if record.exc_info else ""))

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


@pytest.fixture(scope="module")
async def fuzz_server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("fuzz") / "tokens"
    tokens.write_text(f"{GOOD} good\n{LIMITED} limited max_sessions=2\n")
    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, grace_s=1, max_sessions=64, llm=False,
                                        default_responder="echo", auth_tokens=str(tokens), riva=True))
    await server.start()
    yield server
    await server.stop(0)


@pytest.fixture(scope="module")
async def fuzz_bridge(fuzz_server):
    bridge = Bridge(BridgeConfig(target=f"127.0.0.1:{fuzz_server.port}", port=0, max_peers=4,
                                 openai=OpenAIConfig(max_upload_bytes=UPLOAD_LIMIT, realtime=REALTIME_LIMITS),
                                 twilio=TwilioConfig(insecure=True, start_timeout_s=1.0),
                                 server_token=GOOD),  # (what a Twilio call, which has no token, runs with)
                    fuzz_server.tokens)
    await bridge.start()
    yield bridge
    await bridge.stop()


@pytest.fixture(scope="module")
def error_log():
    handler = ErrorLog()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def fuzz_sip(fuzz_server, tmp_path_factory):
    """The SIP door (`rtmedia sip`, a process: PJSIP is one per process) in front of the server."""
    from tests.support.sip import running_door

    log = tmp_path_factory.mktemp("sip") / "sip.log"
    with running_door(f"127.0.0.1:{fuzz_server.port}", "--token", GOOD, "--sip-rtp-timeout", "2",
                      log=log) as door:
        yield SipTarget(door.sip_port, door.control, log, lambda: door.process.poll() is None)


@pytest.fixture(scope="module")
async def target(fuzz_server, fuzz_bridge, fuzz_sip, error_log):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fuzz_server.port}") as channel, \
            aiohttp.ClientSession() as http:
        health = health_pb2_grpc.HealthStub(channel)

        async def sessions() -> int:
            return len(fuzz_server.realtime.sessions)

        async def alive() -> bool:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            return fuzz_server.state == "serving" and reply.status == health_pb2.HealthCheckResponse.SERVING

        async def peers() -> int:
            return len(fuzz_bridge.peers) + fuzz_bridge._opening

        metadata = (("authorization", f"Bearer {GOOD}"),)
        yield Target(channel=channel, token=GOOD, limited_token=LIMITED, sessions=sessions, alive=alive,
                     errors_logged=error_log.take,
                     latent_channels=await probe_latent_channels(channel, metadata),
                     max_receive_bytes=fuzz_server.config.network.max_receive_bytes,
                     features=frozenset({"riva", "web", "auth", "openai", "twilio", "sip"}), sip=fuzz_sip,
                     web_url=f"http://127.0.0.1:{fuzz_bridge.port}", http=http, web_peers=peers,
                     offer_sdp=await offer_sdp(), max_upload_bytes=UPLOAD_LIMIT,
                     max_event_bytes=REALTIME_LIMITS.max_event_bytes, max_frame_bytes=REALTIME_LIMITS.max_frame_bytes)


@pytest.fixture(scope="module")
async def talker(target):
    """The well-behaved session, talking from its first answered turn until the module ends."""
    stop = asyncio.Event()
    talker = Talker(target.channel, target.metadata)
    task = asyncio.ensure_future(talker.run(stop))
    await until(lambda: talker.turns or task.done(), timeout=60, interval=0.1, what="the talker's first turn")
    assert talker.turns and talker.turns[0].status == "completed", (talker.turns, talker.errors)
    target.baseline_sessions = 1
    yield talker
    stop.set()
    await task


class Shown:
    """A case as Hypothesis reports it: abbreviated (audio and latents are megabytes)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return case_repr(self.value)


def _door_test(name: str) -> Any:
    door = DOORS[name]

    @settings(max_examples=EXAMPLES.get(name, DEFAULT_EXAMPLES), **FUZZ)
    @given(case=door.cases.map(Shown))
    async def test(case, target, talker):
        verdict = await run_case(target, door, case.value)
        assert not verdict.problems, f"door {name}: {verdict.problems}\ncase: {case}"

    test.__name__ = test.__qualname__ = f"test_door_{name}"
    return test


for _name in DOORS:
    globals()[f"test_door_{_name}"] = _door_test(_name)


def test_the_targets_realtime_limits_are_serves():
    """The long run (fuzz.py) fuzzes `serve --web`, whose Realtime limits are RealtimeLimits'
    defaults: the Target's defaults are those, so its oversize frames are over them."""
    target = Target(channel=None, token=None, limited_token=None, sessions=None, alive=None, errors_logged=None,
                    latent_channels=1, max_receive_bytes=0, features=frozenset())
    assert (target.max_event_bytes, target.max_frame_bytes) == (RealtimeLimits().max_event_bytes,
                                                                RealtimeLimits().max_frame_bytes)


def test_every_method_the_server_serves_is_a_raw_door(fuzz_server):
    """The raw-bytes and oversize doors reach every service the server registers."""
    fuzzed = {m.path.lstrip("/").rpartition("/")[0] for m in METHODS}
    assert set(fuzz_server.services) <= fuzzed, set(fuzz_server.services) - fuzzed


async def test_the_well_behaved_session_kept_talking(talker):
    """Through all the fuzzing, the session with the right token kept completing its turns."""
    assert len(talker.turns) >= 3, talker.turns
    assert all(t.status == "completed" for t in talker.turns), talker.turns
    assert not talker.errors, talker.errors


async def test_a_missing_static_file_is_a_json_404(target):
    """Found by the web_routes door: aiohttp's static route answered a missing file with an
    empty 404; the page's files are still served, and nothing outside them is."""
    for path in ("/static/no-such-file.js", "/static/..%2fbridge.py", "/static/%2e%2e/bridge.py", "/static/"):
        async with target.http.get(URL(f"{target.web_url}{path}", encoded=True)) as res:
            assert res.status == 404 and (await res.json())["error"], path
    async with target.http.get(f"{target.web_url}/static/app.js") as res:
        assert res.status == 200 and len(await res.read()) > 100


@pytest.mark.parametrize("method, request_", [
    ("Synthesize", speech_pb2.SynthesizeRequest(text="hello", voice="é" * 12000)),
    ("Synthesize", speech_pb2.SynthesizeRequest(text="hello", voice="word " * 5000)),
    ("Transcribe", speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig(language="ü" * 12000))),
])
async def test_a_status_quoting_a_huge_name_still_reaches_the_client(target, method, request_):
    """Found by the synthesize door: a status that quoted a client's 20 KB voice name outgrew the
    client's metadata limit, which then saw RESOURCE_EXHAUSTED (no reason) instead of
    INVALID_ARGUMENT. Statuses are clipped (rtmedia.protocol.errors.rich_status)."""
    from rtmedia.protocol.errors import MAX_MESSAGE_BYTES, error_reason
    from rtmedia.v1 import speech_pb2_grpc

    stub = speech_pb2_grpc.SpeechServiceStub(target.channel)
    call = stub.Synthesize(request_, metadata=target.metadata) if method == "Synthesize" else \
        stub.Transcribe(iter([request_]), metadata=target.metadata)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert error_reason(info.value) in ("UNKNOWN_VOICE", "BAD_LANGUAGE")
    assert len(info.value.details().encode()) <= MAX_MESSAGE_BYTES and "characters)" in info.value.details()


async def test_a_wav_header_cut_inside_a_chunk_is_bad_audio(target):
    """Found by the riva_recognize door: a RIFF/WAVE header whose first chunk is cut short made
    the wave module raise RuntimeError, which ended Recognize with UNKNOWN (and a logged traceback)."""
    from riva.client.proto import riva_asr_pb2, riva_asr_pb2_grpc
    from rtmedia.protocol.errors import error_reason

    request = riva_asr_pb2.RecognizeRequest(audio=b"RIFF$\0\0\0WAVE\t\xdf\xc8a\xb7x\x15\xea9L\xd8\xdc&")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await riva_asr_pb2_grpc.RivaSpeechRecognitionStub(target.channel).Recognize(request, metadata=target.metadata)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_reason(info.value) == "BAD_AUDIO"
    assert not target.errors_logged()


async def test_a_method_left_to_its_generated_default_is_unimplemented(target):
    """Found by the raw_bytes door: Health/List, which grpc_health's servicer leaves to the
    generated default, ended with a traceback in the server's log on every call."""
    from rtmedia.protocol.errors import error_reason

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_pb2_grpc.HealthStub(target.channel).List(health_pb2.HealthListRequest())
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and error_reason(info.value) == "UNIMPLEMENTED"
    assert not target.errors_logged()
