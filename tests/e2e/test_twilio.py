"""Twilio Media Streams on `rtmedia web --twilio` against the real server: requests signed by
Twilio's own RequestValidator (the `twilio` SDK), the documented message shapes, marks returned
once the audio before them has played, as Twilio returns them."""

from __future__ import annotations

import asyncio
import io
import time
import wave
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
from rtmedia.engines.audio.resample import ulaw_to_float

from tests.support.serve import FEW_SPEAKERS, free_port, running_server
from tests.support.speech import wer
from tests.support.twilio import RATE, TOKEN, Twilio, signed, ulaw
from tests.support.webrtc import running_bridge

pytestmark = pytest.mark.e2e
SENTENCE = "Please remember to buy milk and bread on your way home."
LONG = "Please tell me a long story about the weather in the mountains and the rivers and the sea."
INTERRUPTION = "Stop, that is enough."


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    folder = tmp_path_factory.mktemp("twilio")
    (folder / "token").write_text(TOKEN + "\n")
    metrics = free_port()
    with running_server("--no-llm", "--responder", "echo", "--metrics-port", str(metrics), log=folder / "serve.log",
                        asr_decoders=FEW_SPEAKERS) as (target, _), \
            running_bridge(target, "--twilio", "--twilio-auth-token-file", str(folder / "token")) as url:
        yield SimpleNamespace(url=url, metrics=f"http://127.0.0.1:{metrics}/metrics")


async def transcribe(http: aiohttp.ClientSession, url: str, mulaw: bytes) -> str:
    wav = io.BytesIO()
    with wave.open(wav, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes((ulaw_to_float(mulaw) * 32767).astype(np.int16).tobytes())
    form = aiohttp.FormData()
    form.add_field("file", wav.getvalue(), filename="reply.wav", content_type="audio/wav")
    form.add_field("model", "whisper-1")
    async with http.post(f"{url}/v1/audio/transcriptions", data=form) as res:
        assert res.status == 200, await res.text()
        return (await res.json())["text"]


async def test_the_voice_webhook_answers_twiml_to_twilio_only(door):
    params = {"CallSid": "CA0001", "AccountSid": "AC0001", "From": "+15551230000", "To": "+15559870000"}
    url = f"{door.url}/twilio/voice"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, data=params, headers=signed(url, params)) as res:
            assert res.status == 200 and res.content_type == "text/xml"
            twiml = await res.text()
        assert f'<Stream url="{door.url.replace("http", "ws")}/twilio/media">' in twiml
        assert '<Parameter name="From" value="+15551230000"/>' in twiml
        async with http.post(url, data=params) as res:
            assert res.status == 403 and "X-Twilio-Signature is missing" in await res.text()
        async with http.post(url, data={**params, "From": "+15550000000"}, headers=signed(url, params)) as res:
            assert res.status == 403 and "does not match" in await res.text()
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(f"{door.url.replace('http', 'ws')}/twilio/media")
        assert refused.value.status == 403


async def test_a_call_is_heard_answered_and_interrupted(door, speaker):
    media = f"{door.url.replace('http', 'ws')}/twilio/media"
    async with aiohttp.ClientSession() as http, http.ws_connect(media, headers=signed(media)) as ws:
        twilio = Twilio(ws)
        reader = asyncio.ensure_future(twilio.read())
        await twilio.start(From="+15551230000")
        # 1. The caller's sentence is heard and the echo reply comes back as μ-law, marked.
        await twilio.say(ulaw(speaker, SENTENCE))
        await twilio.wait(lambda: twilio.returned and len(twilio.audio) > RATE)
        await twilio.wait(lambda: time.perf_counter() > twilio.play_until + 0.5 and
                          twilio.returned[-1] == twilio.of("mark")[-1][1]["mark"]["name"])
        heard = await transcribe(http, door.url, bytes(twilio.audio))
        assert wer(SENTENCE, heard.lower().removeprefix("you said").strip(" ,:.")) <= 0.3, heard
        assert all(e["streamSid"] == "MZ0001" for _, e in twilio.received)
        async with http.get(door.metrics) as res:  # the call is a session the server counts as Twilio's
            assert 'rtmedia_transport_sessions_active{transport="twilio"} 1.0' in await res.text()
        # A key pressed goes to the session (its answer is the session's, not Twilio's) and the call goes on.
        await ws.send_json({"event": "dtmf", "streamSid": "MZ0001", "sequenceNumber": "9",
                            "dtmf": {"track": "inbound_track", "digit": "5"}})
        # 2. A barge-in: the door sends clear, and the reply's audio stops coming.
        first = len(twilio.audio)
        await twilio.say(ulaw(speaker, LONG))
        await twilio.wait(lambda: len(twilio.audio) > first + RATE)  # a second of the reply is in
        await twilio.say(ulaw(speaker, INTERRUPTION))
        await twilio.wait(lambda: twilio.of("clear"))
        cleared_at = twilio.of("clear")[0][0]
        await asyncio.sleep(1.0)
        late = [e for t, e in twilio.of("media") if cleared_at < t < cleared_at + 0.4]
        assert not late, "reply audio kept coming after the clear"
        await ws.send_json({"event": "stop", "streamSid": "MZ0001", "stop": {"callSid": "CA0001"}})
        await asyncio.wait_for(reader, 10)
        assert ws.close_code == 1000
        for task in twilio.pending.values():
            task.cancel()


@pytest.mark.parametrize(("first", "code", "reason"), [
    ("not json", 1003, "not JSON"),
    ({"event": "media", "streamSid": "MZ1", "media": {"payload": ""}}, 1008, "'media' before start"),
    ({"event": "start", "streamSid": "MZ1", "start": {"streamSid": "MZ1", "mediaFormat": {
        "encoding": "audio/x-l16", "sampleRate": 16000, "channels": 1}}}, 1008, "only audio/x-mulaw"),
    ({"event": "start"}, 1008, "start without streamSid"),
])
async def test_a_socket_that_is_not_twilio_is_closed_with_the_reason(door, first, code, reason):
    media = f"{door.url.replace('http', 'ws')}/twilio/media"
    async with aiohttp.ClientSession() as http, http.ws_connect(media, headers=signed(media)) as ws:
        await (ws.send_str(first) if isinstance(first, str) else ws.send_json(first))
        msg = await ws.receive(timeout=10)
        assert msg.type == aiohttp.WSMsgType.CLOSE and ws.close_code == code, (msg, ws.close_code)
        assert reason in (msg.extra or ""), msg.extra
