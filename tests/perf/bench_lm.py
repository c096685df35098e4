"""LM benchmark: batched decode throughput against one-by-one decode, and the
response latency of the `llm` responder.

    .venv/bin/python tests/perf/bench_lm.py [--steps 32] [--turns 5] [--llm-only]

1. The embedded SmolLM2-135M-Instruct on the LM engine, with int8 linear layers
   (the server's CPU default) and in float32: the prefill time of one chat prompt; 16 sessions
   decoding together against each decoding alone (logit difference, greedy tokens that differ);
   N sessions (1, 4, 16)
   with their own prompts decode `--steps` tokens each, once with one batched
   step for all N per token and once one session at a time, in the same run.
2. A real `rtmedia serve` (default responder `llm`): spoken questions at
   real-time pace; response latency = speech_stopped received -> first reply
   audio byte (docs/protocol.md#latency-definitions), at one session.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rtmedia.engines.lm.engine import EmbeddedLmEngine  # noqa: E402
from rtmedia.engines.lm.models import chat_prompt_ids  # noqa: E402
from rtmedia.engines.responders.contract import Message  # noqa: E402

from tests.perf.bench_realtime import Clip, summary, talk_turns  # noqa: E402
from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.serve import running_server  # noqa: E402
from tests.support.speech import Speaker  # noqa: E402

# Questions PocketSphinx hears (nearly) right in the test voice, so the model answers a real question.
QUESTIONS = ["What is the capital of France?", "How many days are in one week?", "What is the largest planet?"]


def story_prompts(engine: EmbeddedLmEngine, sessions: int) -> list[list[int]]:
    return [chat_prompt_ids(engine.tokenizer, [Message("user", f"Tell me a story about the number {n}.")])
            for n in range(sessions)]


def prefill_ms(engine: EmbeddedLmEngine, repeats: int = 5) -> float:
    """Median time to prefill one chat prompt (~40 tokens) into a fresh slot."""
    [ids] = story_prompts(engine, 1)
    times = []
    for _ in range(repeats):
        slot = engine.acquire()
        started = time.perf_counter()
        engine.prefill(slot, ids)
        times.append(time.perf_counter() - started)
        engine.release(slot)
    return round(sorted(times)[repeats // 2] * 1000, 1)


def batch_invariance(engine: EmbeddedLmEngine, alone: EmbeddedLmEngine, sessions: int = 16, steps: int = 20) -> dict:
    """16 sessions decode together on `engine`; each step of each is repeated by itself on `alone`
    (same model and settings): the largest logit difference and how many greedy tokens differ."""
    prompts = story_prompts(engine, sessions)
    slots = [engine.acquire() for _ in prompts]
    solo = [alone.acquire() for _ in prompts]
    last = {s: int(engine.prefill(s, ids).argmax()) for s, ids in zip(slots, prompts, strict=True)}
    for own, ids in zip(solo, prompts, strict=True):
        alone.prefill(own, ids)
    worst, differ = 0.0, 0
    for _ in range(steps):
        together = engine.decode(last)
        for s, own in zip(slots, solo, strict=True):
            by_itself = alone.decode({own: last[s]})[own]
            worst = max(worst, (together[s] - by_itself).abs().max().item())
            differ += int(together[s].argmax()) != int(by_itself.argmax())
        last = {s: int(together[s].argmax()) for s in slots}
    for s, own in zip(slots, solo, strict=True):
        engine.release(s)
        alone.release(own)
    return {"max_abs_logit_diff": worst, "greedy_tokens_differing": differ, "tokens": sessions * steps}


def throughput(engine: EmbeddedLmEngine, sessions: int, steps: int) -> dict:
    prompts = story_prompts(engine, sessions)
    results = {}
    for mode in ("batched", "one_by_one"):
        slots = [engine.acquire() for _ in range(sessions)]
        last = {slot: int(engine.prefill(slot, ids).argmax()) for slot, ids in zip(slots, prompts, strict=True)}
        started = time.perf_counter()
        for _ in range(steps):
            if mode == "batched":
                logits = engine.decode(last)
            else:
                logits = {slot: engine.decode({slot: token})[slot] for slot, token in last.items()}
            last = {slot: int(logits[slot].argmax()) for slot in last}
        elapsed = time.perf_counter() - started
        for slot in slots:
            engine.release(slot)
        results[mode] = round(sessions * steps / elapsed, 1)
    results["ratio"] = round(results["batched"] / results["one_by_one"], 2)
    return results


async def latency(target: str, turns: int) -> dict:
    speaker = Speaker()
    clips = [Clip(speaker, q) for q in QUESTIONS]
    out: dict = {"response": [], "v2v": [], "statuses": []}
    async with grpc.aio.insecure_channel(target) as channel:
        await talk_turns(channel, clips, turns, 0.0, out, session={"max_output_tokens": 48})
    return {"response_latency_ms": summary(out["response"]), "voice_to_voice_ms": summary(out["v2v"]),
            "completed": out["statuses"].count("completed"), "turns": len(out["statuses"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--llm-only", action="store_true",
                        help="only the llm response latency, with int8 one-session decode speed beside it "
                             "(the machine's speed at the moment, which the latency follows)")
    args = parser.parse_args()
    decode, prefill, invariance = {}, {}, {}
    for quantize in ("int8",) if args.llm_only else ("int8", None):  # the server's default first, then float32
        engines = [EmbeddedLmEngine(slots=16, context=1024, threads=1, quantize=quantize)  # as the server runs it
                   for _ in range(1 if args.llm_only else 2)]  # the second: batch invariance's "alone"
        for engine in engines:
            engine.load()
            engine.warmup()
        name = quantize or "float32"
        decode[name] = {f"sessions_{n}": throughput(engines[0], n, args.steps)
                        for n in ((1,) if args.llm_only else (1, 4, 16))}
        prefill[name] = prefill_ms(engines[0])
        if not args.llm_only:
            invariance[name] = batch_invariance(*engines)
        for engine in engines:
            engine.close()
    with running_server("--metrics-port", "0", "--log-level", "WARNING") as (target, _):
        llm = asyncio.run(latency(target, args.turns))
    print(json.dumps({"benchmark": "lm", "machine": machine(), "model": "SmolLM2-135M-Instruct",
                      "decode_tokens_per_s": decode, "prefill_ms": prefill,
                      "batch_invariance_16_sessions": invariance, "llm_one_session": llm}, indent=2))


if __name__ == "__main__":
    main()
