"""The WebRTC bridge between real processes: `rtmedia serve --web` (echo responder) and
an aiortc peer that speaks into a microphone track and listens to the reply track."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from tests.support.serve import RTMEDIA, free_port
from tests.support.speech import wer
from tests.support.waits import until
from tests.support.webrtc import RATE, BridgePeer, running_bridge, serve_with_web, wait_http

pytestmark = pytest.mark.e2e
SENTENCE = "Please tell me about the weather today."
LONG = "Please tell me a long story about the weather in the mountains and the sea."
INTERRUPTION = "Stop, that is enough."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`rtmedia serve --web`: the server and the bridge beside it, in one process."""
    with serve_with_web(tmp_path_factory.mktemp("web"), "--web-max-peers", "4") as info:
        yield info


@pytest.fixture(scope="module")
def voice(speaker):
    def say(text: str) -> np.ndarray:
        return speaker.say(text, RATE)

    return say


def server_log(served) -> str:
    return Path(served["log"]).read_text(errors="replace")[-4000:]


# Alone: it bounds the acks' pace against real time, which the parallel part's load (the
# recogniser's decodes) delayed by 0.15 s past its 0.3 s margin.
@pytest.mark.serial
async def test_talk_through_the_bridge(served, voice):
    """Words reach the transcript, the reply plays on the track, the bridge acknowledges
    playback from its own playout, and barge-in silences the reply at once."""
    async with aiohttp.ClientSession() as http:
        peer = BridgePeer(served["url"])
        try:
            await peer.connect(http)
            created = await peer.wait_for("session.created")
            await peer.wait_for("bridge.peer")
            assert created["session"]["input_audio_format"]["sample_rate"] in (16000, 24000)
            updated = await peer.wait_for("session.updated")
            assert updated["session"]["output_sample_rate"] == 48000

            # 1. A turn: transcript, reply text, reply audio on the track, acks.
            await asyncio.sleep(0.3)
            duration = peer.mic.say(voice(SENTENCE))
            done = await peer.wait_for("response.done", timeout=20 + duration)
            assert done["status"] == "completed", done
            heard = peer.of_type("conversation.item.input_audio_transcription.completed")[0]["transcript"]
            assert wer(SENTENCE, heard) <= 0.34, heard
            text = peer.of_type("response.output_text.done")[0]["text"]
            assert text.lower().startswith("you said"), text
            deltas = peer.of_type("response.output_audio.delta")
            assert deltas and all(d["audio_bytes"] > 0 and "audio" not in d for d in deltas)
            assert all(d["sample_rate"] == 48000 for d in deltas)
            sent_s = sum(d["audio_bytes"] for d in deltas) / 2 / 48000
            first_delta = deltas[0]["t"]
            audible = peer.first_audible(first_delta - 0.5)
            assert audible is not None, "no reply audio arrived on the track"
            # The whole reply plays out; the last ack (its end, sent by the bridge) comes back.
            acked = await peer.wait_for("playback.acknowledged", timeout=sent_s + 5,
                                        played_ms=done["usage"]["output_audio_ms"])
            acks = peer.of_type("playback.acknowledged")
            assert len(acks) >= 3 and [a["played_ms"] for a in acks] == sorted(a["played_ms"] for a in acks)
            # Acks follow playout at real time, not the (faster) arrival of the deltas.
            assert acked["t"] - first_delta >= sent_s - 0.3, (acked["t"] - first_delta, sent_s)
            loud = [t for t, level in peer.received if level > 0.01 and t > first_delta]
            assert loud and loud[-1] - loud[0] >= 0.5 * sent_s

            # 2. Barge-in: interrupt a long reply while it plays.
            peer.mic.say(voice(LONG))
            created2 = await peer.wait_for("response.created", count=2, timeout=30)
            await peer.wait_for("response.output_audio.delta", response_id=created2["response_id"], timeout=20)
            await asyncio.sleep(1.2)
            peer.mic.say(voice(INTERRUPTION))
            cleared = await peer.wait_for("output_audio_buffer.cleared", timeout=10)
            assert cleared["response_id"] == created2["response_id"]
            report = await peer.wait_for("bridge.playback.cleared", timeout=2)
            assert report["dropped_ms"] > 0, report  # there was queued audio and it was dropped
            cancelled = await peer.wait_for("response.done", response_id=created2["response_id"])
            assert cancelled["status"] == "cancelled"
            # Within ~150 ms (the receiver's own jitter buffer) the track falls silent,
            # until the interruption's own reply starts.
            await asyncio.sleep(0.6)
            after = [level for t, level in peer.received if cleared["t"] + 0.15 < t < cleared["t"] + 0.6]
            assert after and max(after) < 0.003, max(after)
            # The server learnt how much was heard, from the bridge's playout.
            last_ack = [a for a in peer.of_type("playback.acknowledged") if a["response_id"] == cleared["response_id"]]
            assert last_ack and 0 < last_ack[-1]["played_ms"] <= cleared["audio_end_ms"]
        finally:
            await peer.close()
        # The bridge forgets the peer once it closed.
        async def forgotten() -> bool:
            async with http.get(f"{served['url']}/healthz") as res:
                return (await res.json())["peers"] == 0  # a count: /healthz names no peer

        await until(forgotten, interval=0.2, what="the bridge forgetting the closed peer",
                    seen=lambda: server_log(served))


async def test_confirmed_mode_holds_the_track_over_a_backchannel_and_plays_on(served, voice):
    """The bridge paces the reply itself: voice over it (speech_tentative) silences the track at
    once, and a backchannel lets the reply go on from there."""
    async with aiohttp.ClientSession() as http:
        peer = BridgePeer(served["url"])
        try:
            await peer.connect(http)
            await peer.wait_for("session.updated")
            peer.send({"type": "session.update", "event_id": "confirmed",
                       "session": {"turn_detection": {"type": "server_vad", "interruption": {"mode": "confirmed"}}}})
            await peer.wait_for("session.updated", count=2)
            peer.mic.say(voice(LONG))
            created = await peer.wait_for("response.created", timeout=30)
            await peer.wait_for("response.output_audio.delta", response_id=created["response_id"], timeout=20)
            await asyncio.sleep(1.2)
            peer.mic.say(voice("Yeah, okay."))
            tentative = await peer.wait_for("input_audio_buffer.speech_tentative", timeout=10)
            judged = await peer.wait_for("input_audio_buffer.backchannel", timeout=10)
            done = await peer.wait_for("response.done", response_id=created["response_id"], timeout=30)
            assert done["status"] == "completed" and not peer.of_type("output_audio_buffer.cleared")
            held = [level for t, level in peer.received if tentative["t"] + 0.15 < t < judged["t"]]
            assert held and max(held) < 0.003, max(held)  # silent at once, the queued lead kept
            after = [level for t, level in peer.received if t > judged["t"]]
            assert max(after) > 0.01  # and the reply went on
        finally:
            await peer.close()


async def test_page_events_are_checked(served):
    async with aiohttp.ClientSession() as http:
        peer = BridgePeer(served["url"])
        try:
            await peer.connect(http)
            await peer.wait_for("bridge.peer")
            peer.channel.send("{not json")
            bad = await peer.wait_for("bridge.error")
            assert "not valid JSON" in bad["message"]
            peer.send({"type": "response.creat", "event_id": "e1"})
            err = await peer.wait_for("error", event_id="e1")
            assert "response.create" in err["message"]
            peer.send({"type": "session.update", "event_id": "e2", "session": {"output_sample_rate": 16000}})
            err = await peer.wait_for("error", event_id="e2")
            assert err["param"] == "session.output_sample_rate" and "set by the bridge" in err["message"]
            peer.send({"type": "playback.ack", "event_id": "e3", "response_id": "x", "played_ms": 1})
            err = await peer.wait_for("error", event_id="e3")
            assert "bridge" in err["message"]
            peer.send({"type": "session.update", "event_id": "e4", "session": {"turn_detection": {"type": "manual"}}})
            updated = await peer.wait_for("session.updated", count=2)
            assert updated["session"]["turn_detection"]["type"] == "manual"
            peer.send({"type": "bridge.video.request", "latent_shape": [1, 2]})
            err = await peer.wait_for("bridge.video.error")
            assert "latent_shape" in err["message"]
            peer.send({"type": "bridge.video.request"})
            err = await peer.wait_for("bridge.video.error", count=2)
            assert err["code"] == "no_video_track", err  # this offer had no video section
        finally:
            await peer.close()


async def test_offers_are_validated_and_bounded(served, tmp_path):
    """Bad offers get a 4xx naming the problem; a full bridge a 503 saying why; WHIP
    answers 201 with a Location that DELETE ends."""
    url = served["url"]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/offer", data="hello", headers={"Content-Type": "text/plain"}) as res:
            assert res.status == 415 and "application/json" in (await res.json())["error"]
        async with http.post(f"{url}/offer", data="{", headers={"Content-Type": "application/json"}) as res:
            assert res.status == 400 and "not valid JSON" in (await res.json())["error"]
        async with http.post(f"{url}/offer", json={"sdp": "v=0\r\nm=audio x\r\n", "type": "offer"}) as res:
            assert res.status == 400 and "malformed SDP" in (await res.json())["error"]
        async with http.post(f"{url}/offer", json={"sdp": "hello", "type": "answer"}) as res:
            assert res.status == 400 and "'type' must be" in (await res.json())["error"]
        async with http.post(f"{url}/whip", data="v=0\r\n", headers={"Content-Type": "application/sdp"}) as res:
            assert res.status == 400 and "no audio section" in await res.text()

        # WHIP: 201, Location, answer SDP; PATCH is 405; DELETE ends it.
        whip = BridgePeer(url)
        try:
            sdp = await whip.offer_sdp()
            async with http.post(f"{url}/whip", data=sdp, headers={"Content-Type": "application/sdp"}) as res:
                assert res.status == 201, await res.text()
                location = res.headers["Location"]
                assert re.fullmatch(r"/whip/[\w-]+", location) and res.content_type == "application/sdp"
                answer = await res.text()
            assert "a=sendrecv" in answer and "m=audio" in answer
            async with http.patch(f"{url}{location}", data="") as res:
                assert res.status == 405
            # The bridge is bounded: --web-max-peers 4, one is taken; fill it up.
            peers = [BridgePeer(url) for _ in range(3)]
            for p in peers:
                await p.connect(http)
            extra = BridgePeer(url)
            sdp = await extra.offer_sdp()
            async with http.post(f"{url}/offer", json={"sdp": sdp, "type": "offer"}) as res:
                assert res.status == 503
                assert "at most 4 peers" in (await res.json())["error"]
            await extra.close()
            for p in peers:
                await p.close()
            async with http.delete(f"{url}{location}") as res:
                assert res.status == 200
            async with http.delete(f"{url}{location}") as res:
                assert res.status == 404
        finally:
            await whip.close()


def test_web_cli_against_a_missing_server(tmp_path):
    """`rtmedia web` on its own: bound ICE ports, and a clear 502 when the server is not there."""
    web_port, dead_port = free_port(), free_port()
    process = subprocess.Popen([RTMEDIA, "web", "--target", f"127.0.0.1:{dead_port}", "--port", str(web_port),
                                "--udp-ports", "41000-41010"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_http(f"http://127.0.0.1:{web_port}/healthz", process)

        async def offer() -> tuple[int, dict]:
            peer = BridgePeer(f"http://127.0.0.1:{web_port}")
            try:
                sdp = await peer.offer_sdp()
                async with aiohttp.ClientSession() as http, \
                        http.post(f"http://127.0.0.1:{web_port}/offer", json={"sdp": sdp, "type": "offer"}) as res:
                    return res.status, await res.json()
            finally:
                await peer.close()

        status, body = asyncio.run(offer())
        assert status == 502 and "cannot reach the rtmedia server" in body["error"], body
    finally:
        process.terminate()
        out, _ = process.communicate(timeout=15)
    assert process.returncode == 0, out
    assert f"open http://127.0.0.1:{web_port}/" in out.decode()


async def test_video_plays_while_talking(served, voice):
    """A demo DecodeVideo streams onto the video track at the clip's fps while a turn is answered."""
    fps, shape = 12.0, [16, 6, 6, 8]  # -> 1 + 4 * 5 = 21 frames of 48 x 64
    async with aiohttp.ClientSession() as http:
        peer = BridgePeer(served["url"], video=True)
        try:
            await peer.connect(http)
            await peer.wait_for("bridge.peer")
            await asyncio.sleep(0.3)
            peer.send({"type": "bridge.video.request", "latent_shape": shape, "fps": fps, "seed": 7})
            peer.mic.say(voice(SENTENCE))
            started = await peer.wait_for("bridge.video.started", timeout=10)
            done = await peer.wait_for("bridge.video.done", timeout=60)
            assert done["frames"] == 21, done
            chunks = peer.of_type("bridge.video.chunk")
            assert [c["chunk_index"] for c in chunks] == list(range(len(chunks))) and chunks[-1]["is_final"]
            assert sum(c["frame_count"] for c in chunks) == 21
            assert (chunks[0]["width"], chunks[0]["height"]) == (64, 48)
            reply = await peer.wait_for("response.done", timeout=30)
            assert reply["status"] == "completed"
            await until(lambda: len([t for t, _ in peer.video_frames if t >= started["t"]]) >= 18, timeout=5,
                        what="the video's frames on the track", seen=lambda: len(peer.video_frames))
            frames = [t for t, _ in peer.video_frames if t >= started["t"]]
            assert len(frames) >= 18, len(frames)  # a keyframe wait may cost the first one or two
            assert {size for _, size in peer.video_frames} == {(64, 48)}
            span = frames[-1] - frames[0]
            expected = (len(frames) - 1) / fps
            assert 0.8 * expected <= span <= 1.5 * expected + 0.3, (span, expected)
        finally:
            await peer.close()


def test_web_cli_binds_ice_ports_in_range(served):
    """`rtmedia web` beside a running server: ICE candidates use --udp-ports, --max-peers 1 holds."""
    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as http:
            peer, extra = BridgePeer(url), BridgePeer(url)
            try:
                await peer.connect(http)
                answer = peer.pc.remoteDescription.sdp
                ports = [int(line.split()[5]) for line in answer.splitlines() if line.startswith("a=candidate:")]
                assert ports and all(41000 <= p <= 41010 for p in ports), ports
                await peer.wait_for("session.created")
                sdp = await extra.offer_sdp()
                async with http.post(f"{url}/offer", json={"sdp": sdp, "type": "offer"}) as res:
                    assert res.status == 503 and "at most 1 peers" in (await res.json())["error"]
            finally:
                await extra.close()
                await peer.close()

    with running_bridge(served["target"], "--udp-ports", "41000-41010", "--max-peers", "1") as url:
        asyncio.run(check(url))


def test_the_readme_openai_examples_run_against_serve_web(served, tmp_path):
    """README's OpenAI examples, with the official SDK's synchronous client, against the real
    `rtmedia serve --web` process: speech streamed to a file, then transcribed back."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{served['url']}/v1", api_key="unused", max_retries=0)
    path = tmp_path / "hello.wav"
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Please open the kitchen window.", response_format="wav") as response:
        response.stream_to_file(path)
    with open(path, "rb") as audio:
        result = client.audio.transcriptions.create(model="whisper-1", file=audio, response_format="verbose_json")
    assert wer("please open the kitchen window", result.text) <= 0.5, result.text
    assert result.segments and result.segments[0].end > result.segments[0].start
    assert {m.id for m in client.models.list()} >= {"tts-1", "whisper-1"}


def test_the_readme_realtime_example_runs_against_serve_web(served):
    """README's Realtime example (a text turn with the official SDK's async client) against the
    real `rtmedia serve --web` process, whose echo responder says the question back."""
    from openai import AsyncOpenAI

    async def main() -> str:
        client = AsyncOpenAI(base_url=f"{served['url']}/v1", api_key="unused", max_retries=0)
        text = ""
        async with client.realtime.connect(model="gpt-realtime") as conn:
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is the capital of France?"}]})
            await conn.response.create(response={"output_modalities": ["text"]})
            async for event in conn:
                if event.type == "response.output_text.delta":
                    text += event.delta
                elif event.type == "response.done":
                    assert event.response.status == "completed"
                    return text
        return text

    assert asyncio.run(asyncio.wait_for(main(), 60)).endswith("What is the capital of France?")
