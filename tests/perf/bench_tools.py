"""Dead air around a function call: a spoken turn answered through a tool against the same turn
answered without one, in one sitting (docs/protocol.md#tools).

    .venv/bin/python tests/perf/bench_tools.py [--trials 10] [--tool-s 2.0] [--out results.json]

One in-process server (the real VAD, recogniser and TTS) with the `openai` responder on a
stand-in chat-completions server (tests/support/chat_upstream.py) that answers at once. Each
trial is a fresh session and one spoken question (server VAD), in one of three ways, the
order rotating trial by trial:

- `plain`: the upstream answers with text;
- `tool`: the upstream calls a function, the client runs it in 0 ms and sends its output and
  response.create, and the upstream answers from it;
- `slow_tool`: the same with a tool that takes `--tool-s` (the filler speaks meanwhile).

Measured on the client's clock from receiving `speech_stopped`: to the first reply audio of
any kind (`first_audio`), and to the first audio of the answer (`answer_audio`: the reply
for `plain`, the response after the output for the others). Reported per way: p50 and p95 of
both; then `tool` answer p50 minus `plain` p50 (target: within 150 ms), and `slow_tool`
first audio p95 (target: at most 1 s). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from tests.perf.bench_speech import machine  # noqa: E402
from tests.reliability.talker import percentile  # noqa: E402
from tests.support.chat_upstream import Calls, ChatUpstream, tool_results  # noqa: E402
from tests.support.converse import Conversation  # noqa: E402
from tests.support.speech import Speaker  # noqa: E402

RATE = 16000
QUESTION = "What is the weather like in Paris today?"
WAYS = ("plain", "tool", "slow_tool")
WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
           "parameters": json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})}


def script(body: dict[str, Any]) -> list[str | Calls]:
    if "tools" not in body:
        return ["It is sunny in Paris today."]
    if tool_results(body):
        return ["It is sunny in Paris today."]
    return [Calls([("get_weather", {"city": "Paris"})], pieces=1)]


def ms(values: list[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value * 1000, 1)


async def trial(channel: grpc.aio.Channel, pcm: bytes, way: str, tool_s: float) -> dict[str, float]:
    c = await Conversation(channel).__aenter__()
    microphone: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    microphone.set_result(None)
    try:
        session: dict[str, Any] = {"responder": "openai",
                                   "input_audio_format": {"encoding": "pcm16", "sample_rate": RATE}}
        if way != "plain":
            session["tools"] = {"functions": [WEATHER]}
        c.send("session.update", session=session)
        await c.wait_for("session.updated")
        # The microphone goes on sending while the server answers: the client reacts to events at once.
        microphone = asyncio.create_task(c.stream(pcm, RATE, speed=1.0))
        stopped = (await c.wait_for("input_audio_buffer.speech_stopped", timeout=30))["t"]
        if way == "plain":
            first = (await c.wait_for("response.output_audio.delta", timeout=30))["t"] - stopped
            return {"first_audio": first, "answer_audio": first}
        done = await c.wait_for("response.done", timeout=30)  # the reply that calls: no audio of its own
        await asyncio.sleep(tool_s if way == "slow_tool" else 0)
        c.send("conversation.item.create", item={"type": "function_call_output",
                                                 "call_id": done["function_calls"][0]["call_id"],
                                                 "output": '{"sky": "sunny"}'})
        c.send("response.create", event_id="answer")
        answer = await c.wait_for("response.created", request_event_id="answer", timeout=30)
        audio = await c.wait_for("response.output_audio.delta", response_id=answer["response_id"], timeout=30)
        first = c.of_type("response.output_audio.delta")[0]["t"]  # the filler's, or the answer's
        return {"first_audio": first - stopped, "answer_audio": audio["t"] - stopped}
    finally:
        microphone.cancel()
        await asyncio.gather(microphone, return_exceptions=True)
        await c.__aexit__(None, None, None)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from rtmedia.server.app import RtmediaServer
    from rtmedia.server.config import ServerConfig

    speaker = Speaker()
    pcm = np.concatenate([speaker.silence(0.5, RATE), speaker.say(QUESTION, RATE), speaker.silence(1.0, RATE)]
                         ).astype("<i2").tobytes()
    results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    async with ChatUpstream(script) as upstream:
        server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, grace_s=1, llm=False, default_responder="echo",
                                            openai_url=upstream.url, openai_model="stand-in"))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                await trial(channel, pcm, "plain", 0)  # warm-up, not counted
                for n in range(args.trials * len(WAYS)):
                    way = WAYS[(n + n // len(WAYS)) % len(WAYS)]  # every order of the three, in turn
                    results[way].append(await trial(channel, pcm, way, args.tool_s))
        finally:
            await server.stop(0)
    report: dict[str, Any] = {"benchmark": "tools", "machine": machine(), "trials": args.trials,
                              "tool_s": args.tool_s, "ways": {}}
    for way, rows in results.items():
        report["ways"][way] = {f"{what}_{q}_ms": ms([r[what] for r in rows], p)
                               for what in ("first_audio", "answer_audio") for q, p in (("p50", 0.5), ("p95", 0.95))}
    ways = report["ways"]
    report["tool_answer_p50_minus_plain_ms"] = round(ways["tool"]["answer_audio_p50_ms"] -
                                                     ways["plain"]["answer_audio_p50_ms"], 1)
    report["slow_tool_first_audio_p95_ms"] = ways["slow_tool"]["first_audio_p95_ms"]
    report["targets"] = {"tool_answer_p50_minus_plain_ms": "<= 150", "slow_tool_first_audio_p95_ms": "<= 1000"}
    report["raw"] = {way: [{k: round(v * 1000, 1) for k, v in r.items()} for r in rows]
                     for way, rows in results.items()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="trials of each way (default 10)")
    parser.add_argument("--tool-s", type=float, default=2.0, help="how long the slow tool takes (default 2 s)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.trials < 1 or args.tool_s < 0:
        parser.error("--trials must be at least 1 and --tool-s at least 0")
    started = time.perf_counter()
    report = asyncio.run(run(args))
    report["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
