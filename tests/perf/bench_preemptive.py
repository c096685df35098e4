"""Preemptive replies: voice-to-voice with and without them, server_vad beside semantic_vad, in
one sitting.

    .venv/bin/python tests/perf/bench_preemptive.py [--duration 40] [--rounds 2] [--sessions 16]
        [--load-duration 60] [--no-load] [--no-single] [--profiles talk,llm] [--settings semantic_vad:on]
        [--out results.json]

One `rtmedia serve` with the embedded SmolLM2 (semantic_vad scores on it; the `llm` profile
answers with it), the load tester against it (`rtmedia loadtest`, its voice-to-voice: the last
voiced sample sent to the first audible reply sample):

1. One session. `--profile talk` (echo) and `--profile llm` (the embedded LM), each with
   server_vad and semantic_vad, preemptive off and on, `--duration` s each, the settings
   alternating `--rounds` times: voice-to-voice p50/p95, the server's stages p50
   (response.timings), replies committed from a pause.
2. Under load (unless --no-load). `--sessions` talk sessions with a third of the sentences
   paused mid-way (`--paused-share 0.3`), server_vad and semantic_vad (preemptive on), then
   semantic_vad with it off, alternating `--rounds` times: SLO held, voice-to-voice p50,
   server CPU per session-second, the preemptive replies started / committed / discarded /
   skipped (the server's counters): the share discarded and what they cost is the CPU of the
   on run against the off run.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_loadtest import tree_cpu_s  # noqa: E402
from tests.perf.bench_realtime_ws import loadtest, spread  # noqa: E402
from tests.perf.bench_speech import machine, report  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402

SETTINGS = [("server_vad", "off"), ("server_vad", "on"), ("semantic_vad", "off"), ("semantic_vad", "on")]
LOAD_SETTINGS = [("server_vad", "on"), ("semantic_vad", "on"), ("semantic_vad", "off")]
STAGES = ("turn_detection_ms", "transcription_ms", "first_text_ms", "first_audio_ms", "voice_to_voice_ms")


def counters(port: int) -> dict[str, float]:
    """The server's preemptive-reply counters."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.labels["outcome"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "rtmedia_preemptive_replies_total"}


def one(target: str, pid: int, port: int, profile: str, setting: tuple[str, str], sessions: int, duration: float,
        extra: list[str]) -> dict[str, Any]:
    turn, preemptive = setting
    c0, cpu0, t0 = counters(port), tree_cpu_s(pid), time.perf_counter()
    report = loadtest(["--target", target, "--profile", profile, "--sessions", str(sessions), "--duration",
                       str(duration), "--ramp-per-s", "50", "--turn-detection", turn, "--preemptive", preemptive,
                       *extra])
    cpu, wall = tree_cpu_s(pid) - cpu0, time.perf_counter() - t0
    c1 = counters(port)
    stages = report["server_stages_ms"]
    return {"profile": profile, "turn_detection": turn, "preemptive": preemptive, "sessions": sessions,
            "held": report["slo"]["held"], "v2v_p50_ms": report["voice_to_voice_ms"]["p50"],
            "v2v_p95_ms": report["voice_to_voice_ms"]["p95"], "responses": report["responses"],
            "committed_replies": report["preemptive_committed"], "errors": report["errors"],
            "underruns": report["underruns"],
            "server_stages_p50_ms": {k.removesuffix("_ms"): stages[k]["p50"] for k in STAGES},
            "preemptive_counts": {k: int(c1.get(k, 0) - c0.get(k, 0)) for k in c1},
            "server_cpu_ms_per_session_s": round(cpu / wall / sessions * 1000, 2)}


def summary(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return spread([r[key] for r in runs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per one-session run (40)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per setting (2)")
    parser.add_argument("--sessions", type=int, default=16, help="talk sessions under load (16)")
    parser.add_argument("--load-duration", type=float, default=60.0, help="seconds per run under load (60)")
    parser.add_argument("--no-load", action="store_true", help="skip part 2")
    parser.add_argument("--no-single", action="store_true", help="skip part 1")
    parser.add_argument("--profiles", default="talk,llm", help="part 1's profiles (talk,llm)")
    parser.add_argument("--settings", default=None, metavar="TURN:ON|OFF,...",
                        help="part 1's settings (default: both turn detections, preemptive off and on)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    port = free_port()
    result: dict[str, Any] = {"benchmark": "preemptive", "machine": machine()}
    with running_server("--responder", "echo", "--max-sessions", "3000", "--log-level", "WARNING",
                        "--metrics-port", str(port)) as (target, process):
        single: dict[str, list[dict[str, Any]]] = {}
        settings = [tuple(x.split(":")) for x in args.settings.split(",")] if args.settings else SETTINGS
        for round_ in range(0 if args.no_single else args.rounds):
            for profile in args.profiles.split(","):
                for setting in settings if round_ % 2 == 0 else settings[::-1]:
                    run = one(target, process.pid, port, profile, setting, 1, args.duration, [])
                    print(json.dumps(run), file=sys.stderr, flush=True)
                    single.setdefault(f"{profile} {setting[0]} preemptive {setting[1]}", []).append(run)
        result["one_session"] = {} if args.no_single else {name: {"v2v_p50_ms": summary(runs, "v2v_p50_ms"),
                                        "v2v_p95_ms": summary(runs, "v2v_p95_ms"),
                                        "committed": sum(r["committed_replies"] for r in runs),
                                        "responses": sum(r["responses"] for r in runs),
                                        "stages_p50_ms": runs[-1]["server_stages_p50_ms"]}
                                 for name, runs in single.items()}
        if not args.no_load:
            loaded: dict[str, list[dict[str, Any]]] = {}
            for round_ in range(args.rounds):
                for setting in LOAD_SETTINGS if round_ % 2 == 0 else LOAD_SETTINGS[::-1]:
                    run = one(target, process.pid, port, "talk", setting, args.sessions, args.load_duration,
                              ["--paused-share", "0.3"])
                    print(json.dumps(run), file=sys.stderr, flush=True)
                    loaded.setdefault(f"{setting[0]} preemptive {setting[1]}", []).append(run)
            result["under_load"] = {name: {"held": [r["held"] for r in runs],
                                           "v2v_p50_ms": summary(runs, "v2v_p50_ms"),
                                           "server_cpu_ms_per_session_s": summary(runs, "server_cpu_ms_per_session_s"),
                                           "preemptive_counts": [r["preemptive_counts"] for r in runs],
                                           "stages_p50_ms": runs[-1]["server_stages_p50_ms"]}
                                    for name, runs in loaded.items()}
    report(result, args.out)


if __name__ == "__main__":
    main()
