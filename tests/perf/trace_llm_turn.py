"""Where an `llm` reply's time goes: every event of a few spoken turns, in ms after speech_stopped.

    .venv/bin/python tests/perf/trace_llm_turn.py [--turns 6] ["Sentence one." "Sentence two." ...]

An in-process server (default settings, responder `llm`) and one Converse session; each turn is
a Piper-spoken sentence streamed at real-time pace. One line per turn: event names and text
deltas with their time after `input_audio_buffer.speech_stopped`; the first audio delta shows
as `audio`. Prints text, not JSON: it is a tracing aid for the figures in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig

from tests.perf.bench_lm import QUESTIONS
from tests.perf.bench_realtime import CHUNK_MS, RATE, Clip
from tests.support.converse import Conversation
from tests.support.speech import Speaker


def timeline(events: list[dict]) -> str:
    t0 = next(e["t"] for e in events if e["type"] == "input_audio_buffer.speech_stopped")
    parts, seen = [], set()
    for e in events:
        at = f"@{(e['t'] - t0) * 1000:.0f}"
        if e["type"] == "response.output_text.delta":
            parts.append(repr(e["delta"]) + at)
        elif e["type"] not in seen:
            seen.add(e["type"])
            parts.append(("audio" if e["type"] == "response.output_audio.delta" else e["type"].split(".")[-1]) + at)
    return " ".join(parts)


async def trace(sentences: list[str], turns: int) -> None:
    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, grace_s=1))
    await server.start()
    try:
        speaker = Speaker()
        clips = [Clip(speaker, s) for s in sentences]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel, Conversation(channel) as c:
            c.send("session.update", session={"output_sample_rate": 24000, "max_output_tokens": 48})
            for turn in range(turns):
                first = len(c.events)
                await c.stream(clips[turn % len(clips)].pcm, RATE, CHUNK_MS)
                done = await c.wait_for("response.done", count=turn + 1, timeout=60)
                print(timeline(c.events[first:]), flush=True)
                await asyncio.sleep(done["usage"]["output_audio_ms"] / 1000 + 0.3)  # let the reply play out
    finally:
        await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("sentences", nargs="*", default=QUESTIONS)
    args = parser.parse_args()
    asyncio.run(trace(args.sentences, args.turns))


if __name__ == "__main__":
    main()
