"""Two versions of the rtmedia server (two source trees, or plaintext and TLS) under the same
fixed loads, alternately, in one sitting: does a change cost the server anything? For each
round and each version: a fresh `rtmedia serve`
(echo responder, no LM) from that tree, then `rtmedia loadtest` at `listen` 500 sessions in
100 ms chunks and at `talk` 16 sessions in 20 ms chunks (a fresh server for each). Reported
per run: whether the SLO held (p95 of the profile's key latency <= 500 ms, no underruns, no
errors, nobody rejected), the key p95, and the server's CPU (its process tree) per session;
per tree and load: runs held, and the median and spread of CPU per session. The load
generator is the current tree's client in every run, so only the server differs.

    .venv/bin/python tests/perf/bench_versions.py (--before ../before | --tls) [--rounds 4]
        [--listen-duration 30] [--talk-duration 45] [--talk-sessions 16] [--loads listen,talk]
        [--side-by-side | --ping [--pings 2000]]
        [--side-sessions 8]
        [--out results.json]

`--tls` compares this tree's server in plaintext with the same server over TLS (a
throwaway CA and certificate; the load generator verifies it with `--ca`).

`--tls --side-by-side` measures TLS's latency under the noise of this machine: in each
round a plaintext and a TLS server run at once, each with half the `talk` load (8
sessions) from its own load generator, so both see the same moment's machine; control
rounds run two plaintext servers the same way, to show what the probe cannot tell apart.
`--side-sessions N` sets the sessions per side (default 8: half the `talk` load).

`--tls --ping` isolates what TLS adds to the path every reply takes: a plaintext and a TLS
server at once, each under `--side-sessions` talk sessions of load, and one more session on
each that sends an event the server answers at once with an `error` event (a
`response.cancel` with nothing to cancel), alternating between the two servers, `--pings`
times each; reported: each side's round-trip p50/p95 and the p50 of the paired
differences (TLS minus the plaintext ping just before or after it).
Reported per round: each side's response p50/p95 and the p50 difference.

`--before DIR` is a checkout of the other version (e.g. `git worktree add ../before HEAD~3`);
its server runs from that tree's sources through a package directory that maps the
`rtmedia.*` names onto it, with this venv's dependencies. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_loadtest import loadtest, tree_cpu_s  # noqa: E402
from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.serve import RTMEDIA, free_port, wait_serving  # noqa: E402

# import name -> folder of a source tree (pyproject.toml's package-dir)
PACKAGES = {"v1": "proto/rtmedia/v1", "protocol": "proto/rtmedia/protocol", "server": "server",
            "engines": "engines", "kernels": "kernels", "clients": "clients", "web": "web"}
LOADS = {"listen": (500, 100), "talk": (16, 20)}  # profile: (sessions, chunk ms)


def package_dir(tree: Path, into: Path) -> Path:
    """A directory holding an `rtmedia` package whose parts are the tree's folders."""
    pkg = into / "rtmedia"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, folder in PACKAGES.items():
        if (tree / folder).is_dir():
            (pkg / name).symlink_to((tree / folder).resolve(), target_is_directory=True)
    return into


def start_server(pythonpath: Path | None, extra: tuple[str, ...] = (),
                 credentials: Any = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rtmedia.server.cli import main; sys.exit(main())", "serve",
         "--port", str(port), "--metrics-port", "0", "--no-llm", "--responder", "echo", "--max-sessions", "3000",
         "--log-level", "WARNING", *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, server, timeout=180, credentials=credentials)
    except (RuntimeError, TimeoutError):
        server.kill()
        raise
    return server, target


def stop_server(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@dataclass(frozen=True)
class Setting:
    """What one side of the comparison runs: a source tree (None: this one) and the server's
    and the load generator's extra flags."""
    name: str
    pythonpath: Path | None = None
    serve: tuple[str, ...] = ()
    client: tuple[str, ...] = ()
    ca: Path | None = None


def run(setting: Setting, profile: str, duration: float) -> dict:
    import grpc

    sessions, chunk_ms = LOADS[profile]
    credentials = grpc.ssl_channel_credentials(setting.ca.read_bytes()) if setting.ca else None
    server, target = start_server(setting.pythonpath, setting.serve, credentials)
    try:
        cpu0, t0 = tree_cpu_s(server.pid), time.perf_counter()
        report = loadtest(target, ["--profile", profile, "--sessions", str(sessions), "--chunk-ms", str(chunk_ms),
                                   "--duration", str(duration), "--ramp-per-s", "50", *setting.client])
        cpu, wall = tree_cpu_s(server.pid) - cpu0, time.perf_counter() - t0
    finally:
        stop_server(server)
    slo = report["slo"]
    key = {"listen": "vad_start_ms", "talk": "response_latency_ms"}[profile]
    return {"version": setting.name, "profile": profile, "sessions": sessions, "held": slo["held"],
            "verdict": slo["verdict"], "key_p50_ms": (report.get(key) or {}).get("p50"),
            "key_p95_ms": (report.get(key) or {}).get("p95"),
            "underruns": report.get("underruns"), "server_cores": round(cpu / wall, 3),
            "server_cpu_ms_per_session_s": round(cpu / wall / sessions * 1000, 2)}


def side_by_side(pair: tuple[Setting, Setting], duration: float, sessions: int) -> dict:
    """Both settings' servers at once, each under `sessions` talk sessions from its own load
    generator: the response p50 of each, measured over the same seconds."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    servers = []
    try:
        for setting in pair:
            credentials = grpc.ssl_channel_credentials(setting.ca.read_bytes()) if setting.ca else None
            servers.append(start_server(setting.pythonpath, setting.serve, credentials))
        with ThreadPoolExecutor(2) as pool:
            reports = list(pool.map(
                lambda i: loadtest(servers[i][1], ["--profile", "talk", "--sessions", str(sessions), "--chunk-ms",
                                                   "20", "--duration", str(duration), "--ramp-per-s", "50",
                                                   *pair[i].client]), range(2)))
    finally:
        for server, _ in servers:
            stop_server(server)
    sides = [{"version": s.name, "p50_ms": r["response_latency_ms"]["p50"], "p95_ms": r["response_latency_ms"]["p95"],
              "turns": r["response_latency_ms"].get("count"), "underruns": r.get("underruns"),
              "errors": r.get("errors")} for s, r in zip(pair, reports, strict=True)]
    return {"pair": f"{pair[0].name}/{pair[1].name}", "sides": sides,
            "p50_difference_ms": round(sides[1]["p50_ms"] - sides[0]["p50_ms"], 2)}


async def _pings(targets: list[tuple[str, Any]], count: int) -> list[list[float]]:
    """Round trips (ms) of an event the server answers at once, on one session per target,
    alternating targets (and which goes first) so that both see the same moments."""
    import grpc
    from rtmedia.protocol.events import client_event, event_type
    from rtmedia.v1 import realtime_pb2_grpc

    calls, channels = [], []
    for target, credentials in targets:
        channel = (grpc.aio.secure_channel(target, credentials) if credentials
                   else grpc.aio.insecure_channel(target))
        channels.append(channel)
        call = realtime_pb2_grpc.RealtimeServiceStub(channel).Converse()
        await call.write(client_event("session.update", session={}))
        while event_type(await call.read()) != "session.created":
            pass
        calls.append(call)
    cancel = client_event("response.cancel")
    times: list[list[float]] = [[] for _ in targets]
    try:
        for n in range(count + 20):  # the first 20 warm the path up
            for i in (range(len(calls)) if n % 2 == 0 else reversed(range(len(calls)))):
                started = time.perf_counter()
                await calls[i].write(cancel)
                while event_type(await calls[i].read()) != "error":
                    pass
                if n >= 20:
                    times[i].append((time.perf_counter() - started) * 1000)
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
    return times


def ping(pair: tuple[Setting, Setting], count: int, load_sessions: int) -> dict:
    """Both servers at once under `load_sessions` talk sessions each; `count` pings each."""
    import asyncio

    import grpc

    servers, loads = [], []
    targets = []
    try:
        for setting in pair:
            credentials = grpc.ssl_channel_credentials(setting.ca.read_bytes()) if setting.ca else None
            servers.append(start_server(setting.pythonpath, setting.serve, credentials))
            targets.append((servers[-1][1], credentials))
        for setting, (_, target) in zip(pair, servers, strict=True):
            if load_sessions:
                loads.append(subprocess.Popen(
                    [RTMEDIA, "loadtest", "--target", target, "--json", "--quiet",
                     "--profile", "talk", "--sessions", str(load_sessions), "--chunk-ms", "20",
                     "--duration", "3600", "--ramp-per-s", "50", *setting.client],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(5 if load_sessions else 0)  # the load's sessions open and start talking
        times = asyncio.run(_pings(targets, count))
    finally:
        for load in loads:
            load.kill()
            load.wait()
        for server, _ in servers:
            stop_server(server)
    paired = [b - a for a, b in zip(times[0], times[1], strict=True)]

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"pair": f"{pair[0].name}/{pair[1].name}", "pings": count, "load_sessions_each": load_sessions,
            "sides": [{"version": s.name, "p50_ms": pct(t, 0.5), "p95_ms": pct(t, 0.95)}
                      for s, t in zip(pair, times, strict=True)],
            "paired_difference_p50_ms": pct(paired, 0.5)}


def summary(runs: list[dict]) -> dict:
    out: dict = {}
    for run_ in runs:
        out.setdefault(f"{run_['version']} {run_['profile']}", []).append(run_)
    return {key: {"held": f"{sum(r['held'] for r in rs)} of {len(rs)}",
                  "server_cpu_ms_per_session_s_median": statistics.median(r["server_cpu_ms_per_session_s"] for r in rs),
                  "server_cpu_ms_per_session_s_range": [min(r["server_cpu_ms_per_session_s"] for r in rs),
                                                        max(r["server_cpu_ms_per_session_s"] for r in rs)],
                  "key_p50_ms": [r["key_p50_ms"] for r in rs], "key_p95_ms": [r["key_p95_ms"] for r in rs]}
            for key, rs in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--before", type=Path, help="a checkout of the other version")
    which.add_argument("--tls", action="store_true",
                       help="compare this tree's server in plaintext and over TLS (throwaway certificates)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--listen-duration", type=float, default=30.0)
    parser.add_argument("--talk-duration", type=float, default=45.0)
    parser.add_argument("--talk-sessions", type=int, default=LOADS["talk"][0],
                        help="sessions of the talk load (default 16)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="with --tls: plaintext and TLS servers at once, each under half the talk load")
    parser.add_argument("--side-sessions", type=int, default=LOADS["talk"][0] // 2,
                        help="with --side-by-side: talk sessions per server (default 8)")
    parser.add_argument("--ping", action="store_true",
                        help="with --tls: round trips of an event on a plaintext and a TLS server at once")
    parser.add_argument("--pings", type=int, default=2000, help="with --ping: round trips per server")
    parser.add_argument("--control-every", type=int, default=3,
                        help="with --side-by-side: every Nth round is plaintext/plaintext (default 3)")
    parser.add_argument("--loads", default=",".join(LOADS),
                        help="comma-separated loads to run (default listen,talk)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    loads = [name for name in args.loads.split(",") if name]
    if not loads or set(loads) - set(LOADS):
        parser.error(f"--loads: choose from {', '.join(LOADS)}, got {args.loads!r}")
    LOADS["talk"] = (args.talk_sessions, LOADS["talk"][1])
    if (args.side_by_side or args.ping) and not args.tls:
        parser.error("--side-by-side and --ping need --tls")
    if args.before and not (args.before / "server" / "cli.py").is_file():
        parser.error(f"--before {args.before}: not an rtmedia checkout (no server/cli.py)")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.tls:
            from tests.support.certs import make_certs

            certs = make_certs(Path(tmp) / "certs")
            order = [Setting("plaintext"),
                     Setting("tls", serve=("--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)),
                             client=("--ca", str(certs.ca)), ca=certs.ca)]
        else:
            order = [Setting("before", package_dir(args.before, Path(tmp))), Setting("after")]
        if args.ping or args.side_by_side:
            rounds = []
            for n in range(args.rounds):
                pair = (order[0], order[0]) if (n + 1) % args.control_every == 0 else (order[0], order[1])
                rounds.append(ping(pair, args.pings, args.side_sessions) if args.ping
                              else side_by_side(pair, args.talk_duration, args.side_sessions))
                print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
            result = {"machine": machine(), "rounds": rounds}
            if args.side_by_side:
                for key, pair_name in (("tls_minus_plaintext_p50_ms", "plaintext/tls"),
                                       ("control_p50_difference_ms", "plaintext/plaintext")):
                    each = [r["p50_difference_ms"] for r in rounds if r["pair"] == pair_name]
                    result[key] = {"each": each, "median": statistics.median(each) if each else None}
            print(json.dumps(result, indent=1))
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
            return
        for n in range(args.rounds):
            for setting in order if n % 2 == 0 else order[::-1]:
                for profile in loads:
                    duration = args.listen_duration if profile == "listen" else args.talk_duration
                    runs.append(run(setting, profile, duration))
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    result = {"machine": machine(), "rounds": args.rounds, "runs": runs, "summary": summary(runs)}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
