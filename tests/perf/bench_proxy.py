"""`talk` through Debian's haproxy (TLS terminated there, h2c to the server; tests/support/proxy.py)
against the same fixed load straight to the server, alternating, in one sitting: what does the
proxy add to response latency, and do its sessions hold as the direct ones do?

    .venv/bin/python tests/perf/bench_proxy.py [--sessions 16] [--duration 60] [--rounds 4]
        [--settle 5] [--out results.json]

One `rtmedia serve --no-llm --responder echo` process serves every run, behind one haproxy.
Each round runs `rtmedia loadtest --profile talk` at `--sessions` (20 ms chunks) for
`--duration` on each path, `direct` first in even rounds and `proxy` first in odd ones. The
proxy runs on the same cores, so its CPU is reported beside the server's.

Reported per run: whether the SLO held, response latency p50/p95, voice-to-voice p50, errors,
rejected, the load generator's CPU share, the server's CPU per session-second (its process
tree) and the proxy's. Per path: runs held and the median and range of each; then what the
proxy adds to response p50 and p95 (each round's difference and their median). Prints one
JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_loadtest import tree_cpu_s  # noqa: E402
from tests.perf.bench_realtime_ws import alternating_args, loadtest, spread  # noqa: E402
from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.certs import make_certs  # noqa: E402
from tests.support.proxy import Haproxy, combined_pem, replicas  # noqa: E402

PATHS = ("direct", "proxy")
SERVE = ("--no-llm", "--responder", "echo", "--max-sessions", "3000", "--log-level", "WARNING")
CHUNK_MS = 20
RAMP_PER_S = 50


def run(path: str, round_: int, where: list[str], pids: dict[str, int], sessions: int, duration: float) -> dict:
    cpu0, t0 = {name: tree_cpu_s(pid) for name, pid in pids.items()}, time.perf_counter()
    report = loadtest([*where, "--profile", "talk", "--sessions", str(sessions), "--chunk-ms", str(CHUNK_MS),
                       "--duration", str(duration), "--ramp-per-s", str(RAMP_PER_S)])
    wall = time.perf_counter() - t0
    cpu = {name: tree_cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
    response = report["response_latency_ms"]
    return {"round": round_, "path": path, "sessions": sessions, "held": report["slo"]["held"],
            "verdict": report["slo"]["verdict"], "response_p50_ms": response["p50"],
            "response_p95_ms": response["p95"], "responses": response["count"],
            "voice_to_voice_p50_ms": report["voice_to_voice_ms"]["p50"], "underruns": report["underruns"],
            "errors": report["errors"], "errors_by_code": report["errors_by_code"],
            "rejected": report["sessions_rejected"], "loadgen_cpu_share": report["loadgen_cpu_share"],
            "wall_s": round(wall, 2),
            "server_cpu_ms_per_session_s": round(cpu["server"] / wall / sessions * 1000, 2),
            "proxy_cpu_ms_per_session_s": round(cpu["proxy"] / wall / sessions * 1000, 2)}


def summary(runs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in PATHS:
        rs = [r for r in runs if r["path"] == path]
        out[path] = {"held": f"{sum(r['held'] for r in rs)} of {len(rs)}",
                     **{key: spread([r[key] for r in rs]) for key in
                        ("response_p50_ms", "response_p95_ms", "voice_to_voice_p50_ms",
                         "server_cpu_ms_per_session_s", "proxy_cpu_ms_per_session_s")}}
    by_round: dict[int, dict[str, dict]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["path"]] = r
    for key in ("response_p50_ms", "response_p95_ms"):
        added = [round(p["proxy"][key] - p["direct"][key], 1) for p in by_round.values()
                 if len(p) == 2 and p["proxy"][key] is not None and p["direct"][key] is not None]
        out[f"proxy_added_{key}"] = {"per_round": added,
                                     "median": round(statistics.median(added), 1) if added else None}
    return out


def main() -> None:
    args = alternating_args(__doc__, 16, "path")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        directory = Path(tmp)
        certs = make_certs(directory / "certs")
        with replicas(["r1"], *SERVE, log_dir=directory) as (server,):
            proxy = Haproxy(directory, [server], combined_pem(certs.server_cert, certs.server_key,
                                                              directory / "proxy.pem"))
            try:
                proxy.wait_status({"r1": "UP"})
                where = {"direct": ["--target", server.target],
                         "proxy": ["--target", proxy.target, "--ca", str(certs.ca)]}
                pids = {"server": server.process.pid, "proxy": proxy.process.pid}
                for n in range(args.rounds):
                    for path in PATHS if n % 2 == 0 else PATHS[::-1]:
                        if runs:
                            time.sleep(args.settle)
                        runs.append(run(path, n, where[path], pids, args.sessions, args.duration))
                        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
            finally:
                proxy.close()
    result = {"benchmark": "proxy", "machine": machine(), "cores": os.cpu_count(),
              "settings": {"profile": "talk", "sessions": args.sessions, "duration_s": args.duration,
                           "rounds": args.rounds, "chunk_ms": CHUNK_MS, "ramp_per_s": RAMP_PER_S,
                           "serve": ["serve", *SERVE], "proxy": "haproxy (TLS at the proxy, h2c to the server)"},
              "runs": runs, "summary": summary(runs)}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
