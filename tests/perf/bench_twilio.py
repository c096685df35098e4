"""Phone calls through the Twilio door against the same audio over gRPC, in one sitting.

    .venv/bin/python tests/perf/bench_twilio.py [--rounds 6] [--calls 8] [--out results.json]

One `rtmedia serve --no-llm --responder echo` and one `rtmedia web --twilio` in front of it.
Voice-to-voice: a Piper sentence as 8 kHz μ-law, sent at real time (20 ms a message, silence
after it, as Twilio streams), from the message holding its last voiced sample to the first
reply audio back: through the door (Twilio's messages on /twilio/media) and straight to
`Converse` (input G.711 μ-law at 8 kHz, output 8 kHz), rounds alternating. Then `--calls`
concurrent door calls, three sentences each: voice-to-voice p50/p95, and late reply audio (a
`media` message arriving after what came before it had played out, on Twilio's clock).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rtmedia.engines.audio.resample import ULAW_TABLE

from tests.perf.bench_speech import machine, report
from tests.support.converse import Conversation
from tests.support.serve import running_server
from tests.support.speech import Speaker
from tests.support.twilio import RATE, TOKEN, signed, ulaw
from tests.support.webrtc import running_bridge

SENTENCES = ["Please remember to buy milk and bread on your way home.",
             "What time does the pharmacy open in the morning?",
             "My sister is flying back from Lisbon next Thursday."]
CHUNK = 160  # 20 ms of μ-law
SILENCE = bytes([0xFF]) * CHUNK


def last_voiced_chunk(audio: bytes) -> int:
    level = np.abs(ULAW_TABLE[np.frombuffer(audio, np.uint8)].astype(np.int32))
    return int(np.flatnonzero(level > 0.005 * 32768)[-1]) // CHUNK


async def paced(chunks: list[bytes], send, stop: asyncio.Event) -> list[float]:
    """Sends `chunks` then silence at 20 ms a message until `stop`; each chunk's send time."""
    t0, sent, n = time.perf_counter(), [], 0
    while n < len(chunks) or not stop.is_set():
        sent.append(time.perf_counter())
        await send(chunks[n] if n < len(chunks) else SILENCE)
        n += 1
        await asyncio.sleep(max(0.0, t0 + n * 0.02 - time.perf_counter()))
        if n > len(chunks) + 1000:
            break
    return sent


async def return_mark(ws: aiohttp.ClientWebSocketResponse, mark: dict) -> None:
    with contextlib.suppress(aiohttp.ClientError, ConnectionError):
        if not ws.closed:
            await ws.send_json(mark)


async def read_reply(ws: aiohttp.ClientWebSocketResponse, sid: str, first: asyncio.Future[float]) -> int:
    """Plays one reply on Twilio's clock (returning its marks once played) until it has ended;
    sets `first` at its first audio; the media that came late."""
    play_until, late = 0.0, 0
    loop = asyncio.get_running_loop()
    while True:
        try:
            msg = await ws.receive(timeout=0.6 if first.done() else 30)
        except TimeoutError:
            return late  # the reply has ended
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"the door closed the call: {ws.close_code} {msg.extra}")
        event, now = json.loads(msg.data), time.perf_counter()
        if event["event"] == "media":
            if not first.done():
                first.set_result(now)
            elif now > play_until:
                late += 1
            play_until = max(now, play_until) + len(base64.b64decode(event["media"]["payload"])) / RATE
        elif event["event"] == "mark":  # returned once played, as Twilio does
            mark = {"event": "mark", "streamSid": sid, "mark": {"name": event["mark"]["name"]}}
            loop.call_later(max(0.0, play_until - now), lambda m=mark: asyncio.ensure_future(return_mark(ws, m)))


async def door_call(http: aiohttp.ClientSession, media_url: str, clips: list[bytes], sid: str) -> dict:
    """One call saying `clips` in turn, each after the reply to the one before has played."""
    async with http.ws_connect(media_url, headers=signed(media_url)) as ws:
        await ws.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await ws.send_json({"event": "start", "streamSid": sid, "start": {
            "streamSid": sid, "callSid": "CA" + sid, "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": RATE, "channels": 1}}})

        async def send(chunk: bytes) -> None:
            await ws.send_json({"event": "media", "streamSid": sid,
                                "media": {"payload": base64.b64encode(chunk).decode()}})

        v2v, late = [], 0
        for clip in clips:
            first: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            done = asyncio.Event()
            reader = asyncio.ensure_future(read_reply(ws, sid, first))
            sender = asyncio.ensure_future(paced([clip[i:i + CHUNK] for i in range(0, len(clip), CHUNK)], send, done))
            late += await reader
            done.set()
            sent = await sender
            v2v.append((first.result() - sent[last_voiced_chunk(clip)]) * 1000)
        await ws.send_json({"event": "stop", "streamSid": sid})
    return {"v2v_ms": v2v, "late": late}


async def grpc_call(channel: grpc.aio.Channel, clip: bytes) -> float:
    async with Conversation(channel) as c:
        c.send("session.update", session={"input_audio_format": {"encoding": "g711_ulaw", "sample_rate": RATE},
                                          "output_sample_rate": RATE, "responder": "echo",
                                          "turn_detection": {"type": "server_vad"}})
        await c.wait_for("session.updated")
        chunks = [clip[i:i + CHUNK] for i in range(0, len(clip), CHUNK)]
        done = asyncio.Event()

        async def send(chunk: bytes) -> None:
            c.send("input_audio_buffer.append", audio=chunk)

        sender = asyncio.ensure_future(paced(chunks, send, done))
        delta = await c.wait_for("response.output_audio.delta", timeout=30)
        done.set()
        sent = await sender
        return (delta["t"] + c.t0 - sent[last_voiced_chunk(clip)]) * 1000  # (its events' t is from c.t0)


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1)


async def run(target: str, web: str, rounds: int, calls: int) -> dict:
    speaker = Speaker()
    clips = [ulaw(speaker, s, tail_s=0.0) for s in SENTENCES]
    media_url = f"{web.replace('http', 'ws')}/twilio/media"
    door, direct = [], []
    async with aiohttp.ClientSession() as http, grpc.aio.insecure_channel(target) as channel:
        for n in range(rounds):
            clip = clips[n % len(clips)]
            door += (await door_call(http, media_url, [clip], f"MZ{n:04d}"))["v2v_ms"]
            direct.append(await grpc_call(channel, clip))
        many = await asyncio.gather(*(door_call(http, media_url, clips, f"MC{n:04d}") for n in range(calls)))
    added = [d - g for d, g in zip(door, direct, strict=True)]
    together = [v for call in many for v in call["v2v_ms"]]
    return {"rounds": rounds, "door_v2v_ms": {"p50": pct(door, 50), "p95": pct(door, 95)},
            "grpc_v2v_ms": {"p50": pct(direct, 50), "p95": pct(direct, 95)},
            "door_added_p50_ms": pct(added, 50),
            "concurrent": {"calls": calls, "replies": len(together), "v2v_p50_ms": pct(together, 50),
                           "v2v_p95_ms": pct(together, 95), "late_media": sum(c["late"] for c in many)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        token = Path(folder) / "token"
        token.write_text(TOKEN)
        with running_server("--no-llm", "--responder", "echo", "--log-level", "WARNING") as (target, _), \
                running_bridge(target, "--twilio", "--twilio-auth-token-file", str(token)) as web:
            result = {"benchmark": "twilio", "machine": machine(),
                      **asyncio.run(run(target, web, args.rounds, args.calls))}
    report(result, args.out)


if __name__ == "__main__":
    main()
