"""The soak: `rtmedia loadtest` against one real `rtmedia serve` for a long time, watching the
server's resources.

The load is `rtmedia loadtest --profile talk --sessions 13 --chunk-ms 20` by default (80 % of
the `talk` capacity BENCHMARKS.md records for the reference machine) for `--minutes`. It runs as
consecutive loadtest runs of `--window-min` each against the same server, since one run
reports its percentiles over the whole run only: every window's sessions open, speak, are
answered, and close, and the next window's open. Each window is one loadtest report: response
latency and voice-to-voice p50/p95/p99, errors, underruns, rejected sessions.

Beside the load, a snapshot of the server (tests/reliability/resources.py) every `--sample-s`:
resident memory of the main process and of each ASR worker over time. Growth after warm-up
compares the first sample after `--warmup-min` with the last one under load, in %. The
baseline is taken before the load, after a short primer run of the same load (thread and
decoder pools grow to their working size on first use); after the load the server gets
`--settle-s` to return to it, and whatever did not is named.

    .venv/bin/python tests/reliability/soak.py [--minutes 30] [--sessions 13] [--llm]

Each window also records what the server spent on it: CPU seconds of the process tree per
session-second, and the mean engine step time of each lane (from /metrics). With
`--control-min`, a fresh server then runs one window of the same load: whether a late window's
latency is the long-running server's or this machine's at that hour.

Prints one JSON object; exits 1 on a loadtest error, a failed loadtest run, a rejected session
or a resource not back at the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_speech import machine  # noqa: E402
from tests.reliability.resources import (  # noqa: E402
    Snapshot,
    add_settle_flags,
    quiet,
    settle,
    snapshot,
    tolerances_of,
    tree,
)
from tests.support.serve import RTMEDIA, free_port, running_server  # noqa: E402

REPORTED = ("response_latency_ms", "voice_to_voice_ms", "jitter_ms")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid`'s process tree so far (children still alive)."""
    total = 0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def lane_steps(metrics_port: int) -> dict[str, tuple[float, float]]:
    """(seconds, steps) so far of each lane's engine steps, from rtmedia_lane_step_seconds."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "rtmedia_lane_step_seconds":
            continue
        for sample in family.samples:
            lane = sample.labels.get("lane", "")
            if sample.name.endswith("_sum"):
                sums.setdefault(lane, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_count"):
                sums.setdefault(lane, [0.0, 0.0])[1] = sample.value
    return {lane: (v[0], v[1]) for lane, v in sums.items()}


def server_spend(before: tuple[float, dict[str, tuple[float, float]]], after: tuple[float, dict[str, tuple[float, float]]],
                 session_s: float) -> dict[str, Any]:
    """What the server spent between two readings: CPU ms per session-second and mean step ms per lane."""
    steps = {}
    for lane, (seconds, count) in after[1].items():
        was = before[1].get(lane, (0.0, 0.0))
        if count > was[1]:
            steps[lane] = round((seconds - was[0]) / (count - was[1]) * 1000, 3)
    return {"server_cpu_ms_per_session_s": round((after[0] - before[0]) * 1000 / session_s, 2) if session_s else None,
            "mean_step_ms": steps}


async def server_reading(pid: int, metrics_port: int) -> tuple[float, dict[str, tuple[float, float]]]:
    return cpu_seconds(pid), await asyncio.to_thread(lane_steps, metrics_port)


async def loadtest(target: str, args: argparse.Namespace, duration_s: float, seed: int) -> dict[str, Any]:
    """One `rtmedia loadtest` run: the parts of its report a window keeps."""
    command = [RTMEDIA, "loadtest", "--target", target, "--profile", args.profile, "--sessions", str(args.sessions),
               "--chunk-ms", str(args.chunk_ms), "--duration", f"{duration_s:g}", "--ramp-per-s",
               f"{args.ramp_per_s:g}", "--seed", str(seed), "--json", "--quiet"]
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    if process.returncode != 0:
        return {"failed": f"rtmedia loadtest exited with {process.returncode}: "
                          f"{err.decode(errors='replace').strip().splitlines()[-1:]}"}
    report = json.loads(out.decode().strip().splitlines()[-1])
    window = {k: report[k] for k in ("sessions_started", "sessions_completed", "sessions_rejected", "turns",
                                     "responses", "errors", "errors_by_code", "underruns", "wall_s",
                                     "loadgen_cpu_share", "loadgen_late_chunks")}
    for metric in REPORTED:
        window[metric] = report[metric]
    return window


def sample(snap: Snapshot, t0: float) -> dict[str, Any]:
    return {"t_s": round(snap.t - t0, 1), "main_rss_mib": snap.main.rss_mib,
            "workers_rss_mib": {name: p.rss_mib for name, p in snap.processes.items() if name.startswith("worker")},
            "tree_rss_mib": snap.tree_rss_mib, "main_threads": snap.main.threads, "main_fds": snap.main.fds,
            "sessions_active": snap.gauges.get("rtmedia_sessions_active", 0.0)}


def growth(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, float | None]:
    """RSS growth in % from the first sample after warm-up to the last one under load."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 2:
        return {"main_pct": None, "workers_pct": None, "tree_pct": None, "from_t_s": None, "to_t_s": None}
    first, last = after[0], after[-1]

    def pct(a: float, b: float) -> float:
        return round((b - a) / a * 100, 2) if a else 0.0

    return {"main_pct": pct(first["main_rss_mib"], last["main_rss_mib"]),
            "workers_pct": pct(sum(first["workers_rss_mib"].values()), sum(last["workers_rss_mib"].values())),
            "tree_pct": pct(first["tree_rss_mib"], last["tree_rss_mib"]),
            "from_t_s": first["t_s"], "to_t_s": last["t_s"]}


def spread(windows: list[dict[str, Any]], metric: str) -> dict[str, list[float] | None]:
    """The lowest and highest window p50 and p95 of `metric`."""
    out: dict[str, list[float] | None] = {}
    for q in ("p50", "p95"):
        values = [w[metric][q] for w in windows if metric in w and w[metric][q] is not None]
        out[q] = [min(values), max(values)] if values else None
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    metrics_port = free_port()
    responder = () if args.llm else ("--no-llm", "--responder", "echo")
    tolerances = tolerances_of(args)
    result: dict[str, Any] = {"machine": machine(), "settings": {
        "profile": args.profile, "sessions": args.sessions, "chunk_ms": args.chunk_ms, "minutes": args.minutes,
        "window_min": args.window_min, "warmup_min": args.warmup_min, "primer_s": args.primer_s,
        "sample_s": args.sample_s, "llm": args.llm, "tolerances": tolerances.__dict__,
        "windows": "consecutive rtmedia loadtest runs against the same server"}}
    problems: list[str] = []
    with running_server("--metrics-port", str(metrics_port), *responder, "--log-level", "WARNING",
                        log=args.server_log) as (target, server):
        pid = server.pid
        if args.primer_s:
            primer = await loadtest(target, args, args.primer_s, seed=0)
            result["primer"] = {k: primer.get(k) for k in ("failed", "errors", "errors_by_code", "responses")}
            if "failed" in primer:
                problems.append(f"primer: {primer['failed']}")
            _, still = await quiet(metrics_port, args.settle_s)
            if still:
                problems.append(f"the primer left the server busy after {args.settle_s:g} s: {still}")
        baseline = await asyncio.to_thread(snapshot, pid, metrics_port)
        result["baseline"] = baseline.to_json()
        t0 = time.monotonic()
        samples: list[dict[str, Any]] = []
        total_s = args.minutes * 60
        windows: list[dict[str, Any]] = []
        load_done = asyncio.Event()

        async def sampler() -> None:
            while not load_done.is_set():
                samples.append(sample(await asyncio.to_thread(snapshot, pid, metrics_port), t0))
                try:
                    await asyncio.wait_for(load_done.wait(), args.sample_s)
                except TimeoutError:
                    pass

        watcher = asyncio.create_task(sampler())
        try:
            for n in range(math.ceil(total_s / (args.window_min * 60))):
                begun = time.monotonic() - t0
                duration = min(args.window_min * 60, total_s - n * args.window_min * 60)
                reading = await server_reading(pid, metrics_port)
                window = await loadtest(target, args, duration, seed=args.seed + n)
                spent = server_spend(reading, await server_reading(pid, metrics_port), duration * args.sessions)
                windows.append({"index": n, "start_s": round(begun, 1), "end_s": round(time.monotonic() - t0, 1),
                                **window, **spent})
                if "failed" in window:
                    problems.append(f"window {n}: {window['failed']}")
                    break
        finally:
            load_done.set()
            await watcher
        load_s = time.monotonic() - t0
        released, _ = await quiet(metrics_port, args.settle_s)
        after, differences, waited = await settle(pid, metrics_port, baseline, tolerances, args.settle_s)
        if server.poll() is not None:
            problems.append(f"the server exited with {server.returncode}")
    if args.control_min:
        result["control"] = await control_window(args, responder)
        if "failed" in result["control"]:
            problems.append(f"control window: {result['control']['failed']}")
    measured = [w for w in windows if "failed" not in w]
    errors = sum(w["errors"] for w in measured)
    rejected = sum(w["sessions_rejected"] for w in measured)
    if errors:
        problems.append(f"{errors} loadtest errors")
    if rejected:
        problems.append(f"{rejected} sessions rejected")
    if differences:
        problems.append(f"not back at the baseline after {waited:g} s: "
                        + ", ".join(f"{k} {v['baseline']} -> {v['now']}" for k, v in differences.items()))
    result.update({
        "load_s": round(load_s, 1),
        "windows": windows,
        "errors": errors,
        "underruns": sum(w["underruns"] for w in measured),
        "sessions_rejected": rejected,
        "responses": sum(w["responses"] for w in measured),
        "response_latency_spread_ms": spread(measured, "response_latency_ms"),
        "rss_growth_after_warmup": growth(samples, args.warmup_min * 60),
        "rss_timeline": samples,
        "released_s": released,
        "settled_s": waited,
        "after": after.to_json(),
        "not_returned": differences,
        "ok": not problems,
        "problems": problems,
    })
    return result


async def control_window(args: argparse.Namespace, responder: tuple[str, ...]) -> dict[str, Any]:
    """One window of the same load on a fresh server (after the same primer)."""
    metrics_port = free_port()
    with running_server("--metrics-port", str(metrics_port), *responder, "--log-level", "WARNING") as (target, server):
        if args.primer_s:
            await loadtest(target, args, args.primer_s, seed=0)
            await quiet(metrics_port, args.settle_s)
        duration = args.control_min * 60
        reading = await server_reading(server.pid, metrics_port)
        window = await loadtest(target, args, duration, seed=args.seed)
        return {**window, **server_spend(reading, await server_reading(server.pid, metrics_port),
                                         duration * args.sessions)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command's flags, checked."""
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of load (default 30)")
    parser.add_argument("--sessions", type=int, default=13, help="concurrent loadtest sessions (default 13)")
    parser.add_argument("--profile", default="talk", choices=["talk", "llm", "barge-in", "mixed"],
                        help="loadtest profile (default talk)")
    parser.add_argument("--chunk-ms", type=int, default=20, help="audio per append event (default 20)")
    parser.add_argument("--ramp-per-s", type=float, default=10.0, help="sessions started per second (default 10)")
    parser.add_argument("--window-min", type=float, default=5.0,
                        help="minutes of one loadtest run, the window latency is reported over (default 5)")
    parser.add_argument("--warmup-min", type=float, default=2.0,
                        help="minutes of load before RSS growth is measured (default 2)")
    parser.add_argument("--primer-s", type=float, default=15.0,
                        help="seconds of the same load before the baseline is taken; 0: none (default 15)")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between resource samples (default 5)")
    parser.add_argument("--seed", type=int, default=1, help="loadtest seed of the first window (default 1)")
    parser.add_argument("--control-min", type=float, default=0.0,
                        help="then one window of this many minutes on a fresh server; 0: none (default 0)")
    parser.add_argument("--llm", action="store_true",
                        help="serve the embedded LM (for --profile llm); default: --no-llm, echo responder")
    add_settle_flags(parser, "the load")
    args = parser.parse_args(argv)
    for name in ("minutes", "window_min", "sample_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name):g}")
    if args.sessions < 1:
        parser.error(f"--sessions must be at least 1, got {args.sessions}")
    if args.primer_s < 0 or args.warmup_min < 0:
        parser.error("--primer-s and --warmup-min must be 0 or more")
    return args


def main() -> int:
    result = asyncio.run(run(parse_args()))
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
