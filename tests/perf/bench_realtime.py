"""Realtime benchmark: response latency at 1 and 16 concurrent sessions, barge-in
latency, and batched VAD against one call per session.

    .venv/bin/python tests/perf/bench_realtime.py [--turns 8] [--sessions 16]

Drives a real `rtmedia serve` process (echo responder) with speech streamed at
real-time pace in 20 ms chunks and measures at the client by docs/protocol.md#latency-definitions:
- response latency: receiving input_audio_buffer.speech_stopped -> first reply audio byte;
- voice-to-voice: sending the last voiced chunk -> first reply audio byte;
- barge-in: sending the interrupting speech's first voiced chunk -> receiving
  output_audio_buffer.cleared; the server's own figure (audio taken by the VAD
  tick -> cleared) is read from its rtmedia_barge_in_seconds histogram.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rtmedia.clients.loadtest.report import latency_summary as summary  # noqa: E402
from rtmedia.engines.vad.silero import WINDOW, VadEngine, VadItem  # noqa: E402

from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.converse import Conversation  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402
from tests.support.speech import Speaker  # noqa: E402

RATE = 24000
CHUNK_MS = 20
SENTENCES = [
    "Please remember to buy milk and bread on your way home.",
    "The weather today is sunny with a light breeze from the west.",
    "Our meeting starts at nine o'clock in the large room.",
]
LONG = ("Tell me everything about the weather this week, the rain on Monday, the wind on Tuesday, "
        "and the sunshine that everyone expects at the weekend.")


class Clip:
    """A sentence with silence around it, and when its voice starts and ends (ms)."""

    def __init__(self, speaker: Speaker, text: str, lead: float = 0.4, tail: float = 1.0) -> None:
        speech = speaker.say(text, RATE)
        voiced = np.flatnonzero(np.abs(speech) > 0.005 * 32768)
        self.voice_start_ms = lead * 1000 + voiced[0] * 1000 / RATE
        self.voice_end_ms = lead * 1000 + (voiced[-1] + 1) * 1000 / RATE
        self.pcm = np.concatenate([speaker.silence(lead, RATE), speech, speaker.silence(tail, RATE)]).tobytes()


async def talk_turns(channel, clips: list[Clip], turns: int, delay: float, out: dict,
                     session: dict | None = None) -> None:
    """One session: `turns` turns at real-time pace, each after the previous reply."""
    await asyncio.sleep(delay)
    async with Conversation(channel) as c:
        c.send("session.update", session={"output_sample_rate": 24000, **(session or {})})
        for turn in range(turns):
            clip = clips[turn % len(clips)]
            started = await c.stream(clip.pcm, RATE, CHUNK_MS)
            done = await c.wait_for("response.done", count=turn + 1, timeout=60)
            rid = done["response_id"]
            stopped = c.of_type("input_audio_buffer.speech_stopped")[turn]
            first = next(e for e in c.of_type("response.output_audio.delta") if e["response_id"] == rid)
            out["response"].append((first["t"] - stopped["t"]) * 1000)
            last_voiced_sent = started + (clip.voice_end_ms // CHUNK_MS + 1) * CHUNK_MS / 1000
            out["v2v"].append((first["t"] - last_voiced_sent) * 1000)
            out["statuses"].append(done["status"])
            await asyncio.sleep(done["usage"]["output_audio_ms"] / 1000 + 0.3)  # let the reply play out


async def barge_ins(channel, long: Clip, stop: Clip, count: int, out: dict) -> None:
    async with Conversation(channel) as c:
        for n in range(count):
            await c.stream(long.pcm, RATE, CHUNK_MS)
            created = await c.wait_for("response.created", count=2 * n + 1, timeout=30)
            await c.wait_for("response.output_audio.delta", timeout=30, response_id=created["response_id"])
            await asyncio.sleep(0.5)
            started = await c.stream(stop.pcm, RATE, CHUNK_MS)
            cleared = await c.wait_for("output_audio_buffer.cleared", count=n + 1, timeout=10)
            first_voiced_sent = started + (stop.voice_start_ms // CHUNK_MS) * CHUNK_MS / 1000
            out["barge_in"].append((cleared["t"] - first_voiced_sent) * 1000)
            await c.wait_for("response.done", count=2 * n + 2, timeout=30)  # the interrupting turn's reply
            await asyncio.sleep(1.5)


def server_histogram_p(metrics_port: int, name: str, q: float) -> float | None:
    """A quantile of a server histogram, interpolated within its buckets (ms)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    buckets = []
    for line in body.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    target, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= target:
            if upper == float("inf"):
                return round(lower * 1000, 1)
            return round((lower + (upper - lower) * (target - below) / max(count - below, 1e-9)) * 1000, 1)
        lower, below = upper, count
    return None


def vad_batching(streams: int = 64, seconds: float = 2.0) -> dict:
    engine = VadEngine()
    engine.load()
    rng = np.random.default_rng(0)
    audio = (rng.standard_normal((streams, int(seconds * 16000))) * 0.1).astype(np.float32)
    handles = [engine.open_stream() for _ in range(streams)]
    windows = audio.shape[1] // WINDOW
    rounds = [[VadItem(handles[s], audio[s, w * WINDOW:(w + 1) * WINDOW]) for s in range(streams)]
              for w in range(windows)]
    timings = {}
    for name, step in (("batched", engine.step), ("per_session", engine.step_unbatched)):
        started = time.perf_counter()
        for items in rounds:
            step(items)
        timings[name] = time.perf_counter() - started
    per_core = {k: round(streams * windows / v / (1000 / 32), 1) for k, v in timings.items()}
    return {"streams": streams, "realtime_sessions_per_core": per_core,
            "batched_over_per_session": round(timings["per_session"] / timings["batched"], 2)}


async def run(args: argparse.Namespace, target: str, metrics_port: int) -> dict:
    speaker = Speaker()
    clips = [Clip(speaker, s) for s in SENTENCES]
    long, stop = Clip(speaker, LONG, tail=0.6), Clip(speaker, "Wait, stop please.", lead=0.2, tail=1.0)
    report: dict = {}
    async with grpc.aio.insecure_channel(target) as channel:
        for sessions in (1, args.sessions):
            out: dict = {"response": [], "v2v": [], "statuses": []}
            await asyncio.gather(*(talk_turns(channel, clips, args.turns, n * 0.3, out) for n in range(sessions)))
            report[f"sessions_{sessions}"] = {
                "response_latency_ms": summary(out["response"]),
                "voice_to_voice_ms": summary(out["v2v"]),
                "completed": out["statuses"].count("completed"), "turns": len(out["statuses"]),
            }
        out = {"barge_in": []}
        await barge_ins(channel, long, stop, args.barge_ins, out)
        report["barge_in_ms"] = summary(out["barge_in"])
    report["barge_in_ms"]["server_p95"] = server_histogram_p(metrics_port, "rtmedia_barge_in_seconds", 0.95)
    report["barge_in_ms"]["server_p50"] = server_histogram_p(metrics_port, "rtmedia_barge_in_seconds", 0.5)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--barge-ins", type=int, default=8)
    args = parser.parse_args()
    metrics_port = free_port()
    with running_server("--metrics-port", str(metrics_port), "--log-level", "WARNING", "--no-llm",
                        "--responder", "echo") as (target, _):
        report = asyncio.run(run(args, target, metrics_port))
    report = {"benchmark": "realtime", "machine": machine(), "responder": "echo", "chunk_ms": CHUNK_MS,
              **report, "vad": vad_batching()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
