"""semantic_vad against server_vad (500 ms), side by side in one sitting.

    .venv/bin/python tests/perf/bench_semantic_vad.py [--concurrency 4] [--rounds 4] [--sessions 16]
        [--duration 60] [--no-capacity] [--out results.json]

1. Turns. One `rtmedia serve --responder echo` (the embedded SmolLM2 loaded, as semantic_vad
   needs) hears 44 spoken utterances per setting, the settings alternating utterance by
   utterance, `--concurrency` sessions at once: the 24 finished sentences of
   tests/support/turn_texts.py and the 20 sentences of rtmedia.clients.loadtest.speech's
   PAUSED_SENTENCES, paused for 600-900 ms where they are plainly unfinished. Each is
   Piper speech sent at real time, then 4.5 s of silence (past medium's 4 s longest wait).
   Per setting: on finished sentences, end of speech (the VAD's audio_end_ms) to the
   speech_stopped event, p50/p95, and how each turn ended; on paused ones, premature turn
   ends (a turn that ended in the pause) and sentences heard as one turn.
2. Scorers, in this process after the server has gone: the text scorer's log10 P(finished)
   on the transcripts the recogniser gave in part 1 (the finished sentences, and the first
   parts of the paused ones as heard when server_vad cut them), its AUC and its errors at
   each eagerness's first threshold; its CPU per candidate on one thread (words only, onto a
   prefilled prefix, one at a time and 8 in one batch; and the whole prompt); Smart Turn's
   P(complete) on the same audio (the finished sentences, the paused ones up to the pause)
   and its AUC.
3. Capacity. `rtmedia loadtest --profile talk --sessions N --paused-share 0.3` for
   `--duration` s per run, server_vad and semantic_vad alternating (the first setting
   alternating by round), `--rounds` runs each: SLO held, response p50/p95, premature turn
   ends of paused utterances, server CPU per session-second (process tree, /proc), and the
   LM lane's score steps (count, mean batch, their seconds) from the server's /metrics.

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
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_loadtest import tree_cpu_s  # noqa: E402
from tests.perf.bench_realtime_ws import loadtest, spread  # noqa: E402
from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.converse import Conversation  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402
from tests.support.turn_texts import FINISHED  # noqa: E402

RATE = 16000
TAIL_S = 4.5
SETTINGS = ("server_vad", "semantic_vad")
SERVE = ("--responder", "echo", "--max-sessions", "3000", "--log-level", "WARNING")


def utterances() -> list[dict[str, Any]]:
    from rtmedia.clients.loadtest.speech import load_clips, paused_clips, synthesized

    out = []
    for text, clip in zip(FINISHED, load_clips(synthesized(FINISHED), RATE, 20), strict=True):
        out.append({"kind": "finished", "text": text, "clip": clip})
    for clip in paused_clips(RATE, 20, seed=7):
        out.append({"kind": "paused", "text": clip.name, "clip": clip})
    for u in out:
        u["pcm"] = b"".join(c.input_audio_buffer_append.audio for c in u["clip"].chunks)
    return out


async def hear(channel: Any, setting: str, u: dict[str, Any]) -> dict[str, Any]:
    async with Conversation(channel) as c:
        c.send("session.update", session={"input_audio_format": {"sample_rate": RATE}, "turn_detection": {
            "type": setting, "create_response": False}})
        await c.wait_for("session.updated")
        started = await c.stream(u["pcm"] + bytes(int(TAIL_S * RATE) * 2), RATE)
        await asyncio.sleep(0.3)
        stops = [{"audio_end_ms": e["audio_end_ms"], "reason": e.get("reason"), "score": e.get("score"),
                  "wait_ms": round((e["t"] - started) * 1000 - e["audio_end_ms"], 1)}
                 for e in c.of_type("input_audio_buffer.speech_stopped")]
        heard = [e["transcript"] for e in c.of_type("conversation.item.input_audio_transcription.completed")]
    clip = u["clip"]
    result = {"setting": setting, "kind": u["kind"], "text": u["text"], "stops": stops, "transcripts": heard}
    if clip.pause_ms is not None:
        result["premature"] = any(s["audio_end_ms"] < clip.pause_ms[1] for s in stops)
    return result


async def turns(target: str, concurrency: int, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import grpc

    jobs = [(SETTINGS[(n + k) % 2], u) for n, u in enumerate(items) for k in range(2)]  # alternating
    results: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        async def one(setting: str, u: dict[str, Any]) -> None:
            async with gate:
                results.append(await hear(channel, setting, u))

        await asyncio.gather(*(one(s, u) for s, u in jobs))
    return results


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def turn_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for setting in SETTINGS:
        finished = [r for r in results if r["setting"] == setting and r["kind"] == "finished"]
        paused = [r for r in results if r["setting"] == setting and r["kind"] == "paused"]
        waits = [r["stops"][0]["wait_ms"] for r in finished if r["stops"]]
        reasons: dict[str, int] = {}
        for r in finished:
            for s in r["stops"][:1]:
                reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
        out[setting] = {"finished": len(finished), "speech_end_to_stopped_ms": {
            "p50": percentile(waits, 50), "p95": percentile(waits, 95), "each": sorted(waits)},
            "finished_turn_end_reasons": reasons,
            "paused": len(paused), "premature": sum(r["premature"] for r in paused),
            "one_turn": sum(len(r["stops"]) == 1 for r in paused)}
    a, b = (out[s]["speech_end_to_stopped_ms"]["p50"] for s in SETTINGS)
    out["stopped_sooner_p50_ms"] = round(a - b, 1) if None not in (a, b) else None
    pa, pb = (out[s]["premature"] for s in SETTINGS)
    out["premature_ratio"] = round(pb / pa, 3) if pa else None
    return out


def auc(pos: list[float], neg: list[float]) -> float | None:
    if not pos or not neg:
        return None
    return round(sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg)), 4)


def scorers(results: list[dict[str, Any]], items: list[dict[str, Any]]) -> dict[str, Any]:
    import torch
    from rtmedia.engines.lm.engine import EmbeddedLmEngine
    from rtmedia.engines.turn.scorers import AcousticTurnModel, TurnPrompt
    from rtmedia.server.hearing.semantic_turns import THRESHOLDS

    torch.set_num_threads(1)
    engine = EmbeddedLmEngine(slots=8, context=512, quantize="int8", threads=1)
    engine.load()
    prompt = TurnPrompt.of(engine.tokenizer)

    def score(words: str) -> float:
        slot = engine.acquire()
        try:
            return prompt.score(engine.prefill(slot, prompt.ids("", words)))
        finally:
            engine.release(slot)

    heard = [r for r in results if r["setting"] == "server_vad"]
    finished_words = [r["transcripts"][0] for r in heard if r["kind"] == "finished" and r["transcripts"]]
    first_parts = [r["transcripts"][0] for r in heard if r["kind"] == "paused" and r.get("premature")
                   and r["transcripts"]]
    fin, unf = [score(w) for w in finished_words if w], [score(w) for w in first_parts if w]
    text = {"finished": len(fin), "unfinished": len(unf), "auc": auc(fin, unf),
            "finished_range": [round(min(fin), 2), round(max(fin), 2)] if fin else None,
            "unfinished_range": [round(min(unf), 2), round(max(unf), 2)] if unf else None,
            "at_first_threshold": {e: {"finished_below": sum(f < t[0] for f in fin),
                                       "unfinished_above": sum(u >= t[0] for u in unf)}
                                   for e, t in THRESHOLDS.items()},
            "unfinished_as_heard": dict(zip(first_parts, (round(u, 2) for u in unf), strict=False))}
    # CPU per candidate, one thread: the words onto a prefilled prefix, alone and 8 at once; the whole prompt.
    words = [w for w in finished_words + first_parts if w][:16]
    prefix = prompt.prefix("")
    cpu = {}
    for label, batch in (("words_one_at_a_time", 1), ("words_batched_8", 8)):
        spent, count = 0.0, 0
        for i in range(0, len(words), batch):
            group = words[i:i + batch]
            slots = [engine.acquire() for _ in group]
            for s in slots:
                engine.prefill(s, prefix)
            t0 = time.process_time()
            engine.prefill_many({s: prompt.ids("", w)[len(prefix):] for s, w in zip(slots, group, strict=True)})
            spent += time.process_time() - t0
            count += len(group)
            for s in slots:
                engine.release(s)
        cpu[label] = round(spent / count * 1000, 1)
    t0 = time.process_time()
    for w in words:
        score(w)
    cpu["whole_prompt"] = round((time.process_time() - t0) / len(words) * 1000, 1)
    engine.close()
    # Smart Turn on the same audio: finished sentences; paused ones up to their pause (+200 ms).
    model = AcousticTurnModel()
    model.load()

    def audio_until(u: dict[str, Any], end_ms: float) -> np.ndarray:
        pcm = np.frombuffer(u["pcm"], np.int16)[:int((end_ms + 200) * RATE / 1000)]
        return pcm.astype(np.float32) / 32768

    t0 = time.process_time()
    p_fin = [model.score(audio_until(u, u["clip"].voice_end_ms)) for u in items if u["kind"] == "finished"]
    p_unf = [model.score(audio_until(u, u["clip"].pause_ms[0])) for u in items if u["kind"] == "paused"]
    acoustic_cpu = (time.process_time() - t0) / (len(p_fin) + len(p_unf)) * 1000
    acoustic = {"auc": auc(p_fin, p_unf), "finished_range": [round(min(p_fin), 3), round(max(p_fin), 3)],
                "unfinished_range": [round(min(p_unf), 3), round(max(p_unf), 3)],
                "unfinished_at_or_above_0.5": sum(p >= 0.5 for p in p_unf), "cpu_ms_per_call": round(acoustic_cpu, 1)}
    return {"text": text, "text_cpu_ms_per_candidate": cpu, "acoustic": acoustic}


def metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("rtmedia_turn_score_batch_size_count", "rtmedia_turn_score_batch_size_sum",
                               "rtmedia_turn_score_seconds_sum", "rtmedia_turn_score_seconds_count"):
                out[sample.name] = sample.value
            elif sample.name == "rtmedia_lane_step_seconds_sum" and sample.labels.get("lane") == "llm":
                out["llm_step_seconds"] = sample.value
            elif sample.name == "rtmedia_turn_ends_total":
                out[f"turn_ends_{sample.labels['reason']}"] = sample.value
    return out


def capacity_run(setting: str, round_: int, target: str, pid: int, metrics_port: int, sessions: int,
                 duration: float) -> dict[str, Any]:
    m0, cpu0, t0 = metrics(metrics_port), tree_cpu_s(pid), time.perf_counter()
    report = loadtest(["--target", target, "--profile", "talk", "--sessions", str(sessions), "--duration",
                       str(duration), "--ramp-per-s", "50", "--turn-detection", setting, "--paused-share", "0.3"])
    cpu, wall = tree_cpu_s(pid) - cpu0, time.perf_counter() - t0
    m1 = metrics(metrics_port)
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    scores = d.get("rtmedia_turn_score_batch_size_sum", 0.0)
    steps = d.get("rtmedia_turn_score_batch_size_count", 0.0)
    response = report["response_latency_ms"]
    return {"round": round_, "setting": setting, "held": report["slo"]["held"], "verdict": report["slo"]["verdict"],
            "response_p50_ms": response["p50"], "response_p95_ms": response["p95"],
            "voice_to_voice_p50_ms": report["voice_to_voice_ms"]["p50"],
            "paused_turns": report["paused_turns"], "premature_turn_ends": report["premature_turn_ends"],
            "underruns": report["underruns"], "errors": report["errors"], "errors_by_code": report["errors_by_code"],
            "server_cpu_ms_per_session_s": round(cpu / wall / sessions * 1000, 2),
            "scores": int(scores), "score_steps": int(steps),
            "mean_score_batch": round(scores / steps, 2) if steps else None,
            "score_wall_ms_mean": round(d["rtmedia_turn_score_seconds_sum"] / d["rtmedia_turn_score_seconds_count"]
                                        * 1000, 1) if d.get("rtmedia_turn_score_seconds_count") else None,
            "llm_lane_step_s": round(d.get("llm_step_seconds", 0.0), 2),
            "turn_ends": {k.removeprefix("turn_ends_"): int(v) for k, v in d.items() if k.startswith("turn_ends_")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=4, help="utterance sessions at once in part 1 (4)")
    parser.add_argument("--rounds", type=int, default=4, help="capacity runs per setting (4)")
    parser.add_argument("--sessions", type=int, default=16, help="talk sessions per capacity run (16)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per capacity run (60)")
    parser.add_argument("--no-capacity", action="store_true", help="skip part 3")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    items = utterances()
    metrics_port = free_port()
    out: dict[str, Any] = {"machine": machine(), "utterances": len(items)}
    with running_server(*SERVE, "--metrics-port", str(metrics_port)) as (target, server):
        results = asyncio.run(turns(target, args.concurrency, items))
        out["turns"] = turn_summary(results)
        out["turn_metrics"] = metrics(metrics_port)
        if not args.no_capacity:
            runs = []
            for round_ in range(args.rounds):
                for setting in (SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]):
                    runs.append(capacity_run(setting, round_, target, server.pid, metrics_port, args.sessions,
                                             args.duration))
                    time.sleep(5)
            out["capacity_runs"] = runs
            out["capacity"] = {s: {"held": f"{sum(r['held'] for r in runs if r['setting'] == s)} of "
                                           f"{sum(r['setting'] == s for r in runs)}",
                                   **{k: spread([r[k] for r in runs if r["setting"] == s])
                                      for k in ("response_p50_ms", "response_p95_ms", "server_cpu_ms_per_session_s",
                                                "premature_turn_ends", "paused_turns", "llm_lane_step_s")}}
                               for s in SETTINGS}
    out["scorers"] = scorers(results, items)
    out["results"] = results
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
