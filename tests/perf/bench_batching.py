"""Batching across sessions on one intra-op thread, offline: the VAD engine's windows and the
LM engine's decode tokens per second, batched against one call per session.

    .venv/bin/python tests/perf/bench_batching.py [--rounds 3] [--steps 8]

1. VAD (`VadEngine`, Silero on onnxruntime): one 32 ms window for each of N sessions (1, 32,
   64, 128) per step, `step` (batched) against `step_unbatched` (one model call per window):
   windows per second of wall time and of CPU time, and the sessions that rate keeps in real
   time (31.25 windows per second each).
2. LM (`LmEngine`, float32, random weights, nothing downloaded): the tiny model of the unit
   tests and a SmolLM2-135M-shaped one, N sessions (1, 4, 16) decoding `--steps` tokens each
   after a 32-token prompt, one batched decode per token against one decode per session.

CPU figures are the best of `--rounds` rounds taken in turn (tests/support/throughput.py), as
the unit tests' ratio assertions take them; wall figures are from the same rounds.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rtmedia.engines.lm.engine import LmEngine  # noqa: E402
from rtmedia.engines.vad.silero import SAMPLE_RATE, WINDOW, VadEngine  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.throughput import decoding_slots, vad_windows  # noqa: E402

# The unit tests' tiny Llama (tests/unit/test_lm_engine.py) and SmolLM2-135M's shapes.
MODELS = {
    "tiny": dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "smollm2_135m_shaped": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                tie_word_embeddings=True),
}
PROMPT = 32


def timed(run: Callable[[], object], calls: int) -> tuple[float, float]:
    """(wall s, CPU s) per call of `run`, over `calls` calls."""
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        run()
    return (time.perf_counter() - w0) / calls, (time.process_time() - c0) / calls


def best_in_turn(rounds: int, **runs: tuple[Callable[[], object], int]) -> dict[str, tuple[float, float]]:
    """For each named (run, calls): the least wall and the least CPU time per call over `rounds`
    rounds, each round running them all, in the reverse order of the round before."""
    names = list(runs)
    best = {name: (float("inf"), float("inf")) for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = timed(*runs[name])
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def vad(rounds: int) -> dict:
    engine = VadEngine()
    engine.load()
    engine.warmup()
    out: dict = {}
    try:
        for sessions in (1, 32, 64, 128):
            items = vad_windows(sessions)
            calls = max(8, 512 // sessions)
            best = best_in_turn(rounds, batched=(partial(engine.step, items), calls),
                                one_by_one=(partial(engine.step_unbatched, items), calls))
            row: dict = {}
            for name, (wall, cpu) in best.items():
                rate_wall, rate_cpu = sessions / wall, sessions / cpu
                row[name] = {"windows_per_s_wall": round(rate_wall), "windows_per_s_cpu": round(rate_cpu),
                             "realtime_sessions_cpu": round(rate_cpu * WINDOW / SAMPLE_RATE)}
            row["cpu_one_by_one_over_batched"] = round(best["one_by_one"][1] / best["batched"][1], 2)
            out[f"sessions_{sessions}"] = row
    finally:
        engine.close()
    return out


def decode_one_by_one(engine: LmEngine, tokens: dict[int, int]) -> None:
    for slot, token in tokens.items():
        engine.decode({slot: token})


def lm(rounds: int, steps: int) -> dict:
    out: dict = {}
    for label, shape in MODELS.items():
        torch.manual_seed(0)
        context = PROMPT + 1 + 2 * rounds * steps
        engine = LmEngine(model=LlamaForCausalLM(LlamaConfig(**shape)), slots=16, context=context)
        engine.load()
        engine.warmup()
        rows: dict = {}
        try:
            for sessions in (1, 4, 16):
                with decoding_slots(engine, sessions, shape["vocab_size"], PROMPT) as tokens:
                    engine.decode(tokens)
                    best = best_in_turn(rounds, batched=(partial(engine.decode, tokens), steps),
                                        one_by_one=(partial(decode_one_by_one, engine, tokens), steps))
                row: dict = {name: {"tokens_per_s_wall": round(sessions / wall, 1),
                                    "tokens_per_s_cpu": round(sessions / cpu, 1)}
                             for name, (wall, cpu) in best.items()}
                row["cpu_one_by_one_over_batched"] = round(best["one_by_one"][1] / best["batched"][1], 2)
                rows[f"sessions_{sessions}"] = row
        finally:
            engine.close()
        out[label] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per LM measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"benchmark": "batching", "machine": machine(), "intra_op_threads": 1, "rounds": args.rounds,
              "vad": vad(args.rounds), "lm": lm(args.rounds, args.steps)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
