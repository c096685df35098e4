"""`talk` over OpenAI's Realtime API (the web front's `/v1/realtime` WebSocket) against the same
fixed load over gRPC (`RealtimeService.Converse`), alternating, in one sitting: what does the
WebSocket door cost the server, and do its sessions hold the SLO as the gRPC ones do?

    .venv/bin/python tests/perf/bench_realtime_ws.py [--sessions 13] [--duration 60] [--rounds 4]
        [--settle 5] [--out results.json]

One `rtmedia serve --no-llm --responder echo --web` process serves every run. The web front
runs in the server's own process and event loop (`serve --web`), so the server's CPU (its
process tree: the main process and its recogniser workers, read from /proc) includes
everything the WebSocket door costs. Each round runs `rtmedia loadtest --profile talk` at
`--sessions` (20 ms chunks) for `--duration` over each transport, `grpc` first in even rounds
and `openai-ws` first in odd ones, with `--settle` seconds between runs.

Reported per run: whether the SLO held (response latency p95 <= 500 ms, no underruns, no
errors, nobody rejected), response latency p50/p95, voice-to-voice p50, underruns, errors,
the load generator's CPU share, and the server's CPU per session-second (its CPU over the run
divided by the sessions and the run's wall time). Per transport: runs held, and the median and
range of response p50, p95 and server CPU per session-second. Then the ratio openai-ws / grpc
of server CPU per session-second (each round's own ratio, their median, and the ratio of the
medians) and the WebSocket's added server CPU per session-second (ms, the same three ways).
The server's idle CPU (measured before the first run) is stated beside them. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_loadtest import tree_cpu_s  # noqa: E402
from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.serve import RTMEDIA, free_port, running_server  # noqa: E402
from tests.support.webrtc import wait_http  # noqa: E402

TRANSPORTS = ("grpc", "openai-ws")
SERVE = ("--no-llm", "--responder", "echo", "--metrics-port", "0", "--max-sessions", "3000", "--log-level", "WARNING")
CHUNK_MS = 20
RAMP_PER_S = 50
IDLE_S = 5.0


def loadtest(args: list[str]) -> dict[str, Any]:
    """One `rtmedia loadtest ... --json --quiet`; its report, or its one-line error as a RuntimeError."""
    result = subprocess.run([RTMEDIA, "loadtest", "--json", "--quiet", *args], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0 or not result.stdout.strip():
        said = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"rtmedia loadtest {' '.join(args)} failed ({result.returncode}): {said}")
    return json.loads(result.stdout.splitlines()[-1])


def run(transport: str, round_: int, target: str, web_url: str, pid: int, sessions: int, duration: float) -> dict:
    where = ["--target", target] if transport == "grpc" else ["--transport", "openai-ws", "--web-url", web_url]
    cpu0, t0 = tree_cpu_s(pid), time.perf_counter()
    report = loadtest([*where, "--profile", "talk", "--sessions", str(sessions), "--chunk-ms", str(CHUNK_MS),
                       "--duration", str(duration), "--ramp-per-s", str(RAMP_PER_S)])
    cpu, wall = tree_cpu_s(pid) - cpu0, time.perf_counter() - t0
    response = report["response_latency_ms"]
    return {"round": round_, "transport": report.get("transport", transport), "sessions": sessions,
            "held": report["slo"]["held"], "verdict": report["slo"]["verdict"],
            "response_p50_ms": response["p50"], "response_p95_ms": response["p95"], "responses": response["count"],
            "voice_to_voice_p50_ms": report["voice_to_voice_ms"]["p50"],
            "transcript_final_p95_ms": report["transcript_final_ms"]["p95"],
            "underruns": report["underruns"], "errors": report["errors"], "errors_by_code": report["errors_by_code"],
            "rejected": report["sessions_rejected"], "loadgen_cpu_share": report["loadgen_cpu_share"],
            "server_cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "server_cores": round(cpu / wall, 3),
            "server_cpu_ms_per_session_s": round(cpu / wall / sessions * 1000, 2)}


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median and range of the values that were measured (None: not measured)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "range": None, "each": values}
    return {"median": round(statistics.median(got), 2), "range": [min(got), max(got)], "each": values}


def summary(runs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for transport in TRANSPORTS:
        rs = [r for r in runs if r["transport"] == transport]
        out[transport] = {"held": f"{sum(r['held'] for r in rs)} of {len(rs)}",
                          **{key: spread([r[key] for r in rs]) for key in
                             ("response_p50_ms", "response_p95_ms", "server_cpu_ms_per_session_s")}}
    per_round = {}
    for r in runs:
        per_round.setdefault(r["round"], {})[r["transport"]] = r["server_cpu_ms_per_session_s"]
    pairs = [(p["grpc"], p["openai-ws"]) for p in per_round.values() if len(p) == 2]
    medians = [out[t]["server_cpu_ms_per_session_s"]["median"] for t in TRANSPORTS]
    ratios = [round(ws / grpc, 3) for grpc, ws in pairs if grpc > 0]
    added = [round(ws - grpc, 2) for grpc, ws in pairs]
    out["openai_ws_over_grpc_cpu_per_session_s"] = {
        "per_round": ratios, "median": round(statistics.median(ratios), 3) if ratios else None,
        "of_medians": round(medians[1] / medians[0], 3) if all(medians) else None}
    out["openai_ws_added_cpu_ms_per_session_s"] = {
        "per_round": added, "median": round(statistics.median(added), 2) if added else None,
        "of_medians": round(medians[1] - medians[0], 2) if None not in medians else None}
    return out


def alternating_args(doc: str, sessions: int, what: str) -> argparse.Namespace:
    """The command line of a benchmark that alternates fixed-load `talk` runs over `what`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=sessions, help=f"talk sessions per run (default {sessions})")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per run (default 60)")
    parser.add_argument("--rounds", type=int, default=4, help=f"rounds, each one run per {what} (default 4)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds between runs (default 5)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.sessions < 1 or args.rounds < 1 or args.duration <= 0 or args.settle < 0:
        parser.error("--sessions and --rounds must be at least 1, --duration positive, --settle not negative")
    return args


def main() -> None:
    args = alternating_args(__doc__, 13, "transport")
    web_port = free_port()
    runs: list[dict] = []
    with running_server(*SERVE, "--web", "--web-port", str(web_port)) as (target, server):
        web_url = f"http://127.0.0.1:{web_port}"
        wait_http(f"{web_url}/healthz", server)
        cpu0 = tree_cpu_s(server.pid)
        time.sleep(IDLE_S)
        idle_cores = (tree_cpu_s(server.pid) - cpu0) / IDLE_S
        for n in range(args.rounds):
            for transport in TRANSPORTS if n % 2 == 0 else TRANSPORTS[::-1]:
                if runs:
                    time.sleep(args.settle)
                runs.append(run(transport, n, target, web_url, server.pid, args.sessions, args.duration))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    result = {"benchmark": "realtime_ws", "machine": machine(), "cores": os.cpu_count(),
              "settings": {"profile": "talk", "sessions": args.sessions, "duration_s": args.duration,
                           "rounds": args.rounds, "chunk_ms": CHUNK_MS, "ramp_per_s": RAMP_PER_S,
                           "serve": ["serve", *SERVE, "--web"]},
              "server_idle_cores": round(idle_cores, 3), "runs": runs, "summary": summary(runs)}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
