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
        [--listen-duration 30] [--talk-duration 45] [--out results.json]

`--tls` compares this tree's server in plaintext with the same server over TLS (a
throwaway CA and certificate; the load generator verifies it with `--ca`).

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
from tests.support.serve import free_port, wait_serving  # noqa: E402

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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
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
        for n in range(args.rounds):
            for setting in order if n % 2 == 0 else order[::-1]:
                for profile in LOADS:
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
