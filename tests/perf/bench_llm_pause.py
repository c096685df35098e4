"""Does pausing the LM while a reply's first clause is synthesised shorten the `llm` response
latency? Both ways in one run, on one in-process server (default settings, responder `llm`)
a Converse session per block of the spoken questions of bench_lm.py, blocks alternately with
the pause (the server's behaviour) and without it (the lane ignores the session's pause).

    .venv/bin/python tests/perf/bench_llm_pause.py [--turns 18]

Response latency per docs/protocol.md#latency-definitions: speech_stopped received -> first reply audio delta received.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig
from rtmedia.server.lanes import lm_lane

from tests.perf.bench_lm import QUESTIONS
from tests.perf.bench_realtime import Clip, talk_turns
from tests.perf.bench_speech import machine
from tests.support.speech import Speaker

PAUSING = [True]
_pause = lm_lane.LmLane.pause


def pause(self, conversation):
    if PAUSING[0]:
        _pause(self, conversation)


async def run(turns: int) -> dict:
    lm_lane.LmLane.pause = pause
    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, grace_s=1))
    await server.start()
    latency: dict[bool, list[float]] = {True: [], False: []}
    try:
        clips = [Clip(Speaker(), q) for q in QUESTIONS]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for block in range(-(-turns // len(clips))):  # a session per block: every question once
                PAUSING[0] = block % 2 == 0
                out: dict = {"response": [], "v2v": [], "statuses": []}
                await talk_turns(channel, clips, len(clips), 0.0, out, session={"max_output_tokens": 48})
                latency[PAUSING[0]] += [round(ms, 1) for ms in out["response"]]
    finally:
        await server.stop(0)
        lm_lane.LmLane.pause = _pause

    def summary(values: list[float]) -> dict:
        return {"p50_ms": statistics.median(values), "all_ms": values}

    paused, plain = summary(latency[True]), summary(latency[False])
    return {"benchmark": "llm_first_clause_pause", "machine": machine(), "turns": turns,
            "with_pause": paused, "without_pause": plain,
            "p50_gain_ms": round(plain["p50_ms"] - paused["p50_ms"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=18)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.turns)), indent=2))


if __name__ == "__main__":
    main()
