"""Capacity with `rtmedia loadtest --find-capacity`, and the frame-path overhead
against a bare grpc.aio bidi servicer, on this machine with the load generator on
the same box.

    .venv/bin/python tests/perf/bench_loadtest.py [--profiles listen,transcribe,talk,llm] [--frame-path]
        [--noise-reduction listen:200,talk:6] [--interruptions 4] [--duration 30] [--out results.json]

Each profile gets a fresh `rtmedia serve` (echo responder and no LM, except for
llm) and a capacity search (SLO: p95 of the profile's key latency <= 500 ms, no
underruns, no errors, nobody rejected). Reported per level: the SLO verdict, the
load generator's CPU share (of all cores) and the server's (its process tree).

Frame path: `listen` with turn detection none and transcription off (every
chunk goes through the session's input path and nothing else) against a bare
grpc.aio servicer of the same RealtimeService.Converse that only reads the
chunks; both take the same paced load; the ratio is frames per server CPU-second
(rtmedia / bare; 1.0 means the frame path costs no more than gRPC itself).

Noise reduction (`--noise-reduction PROFILE:SESSIONS,...`): fixed runs of each profile at that
many sessions on a server started with `--noise-reduction off`, `near_field` and `far_field`:
the server's CPU (its process tree) per session-second, the key latency and the SLO verdict.

Interruptions (`--interruptions SESSIONS`): fixed barge-in runs (every reply talked over; of
the voices 40 % backchannels, 20 % noise bursts, the rest real interruptions) in `immediate`
and `confirmed` mode: replies cancelled by each kind and the real interruptions' barge-in
latency. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.serve import RTMEDIA, free_port, running_server, wait_serving  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
# profile: (first level, chunk ms, serve args)
PROFILES = {
    "listen": (100, 100, ["--no-llm", "--responder", "echo"]),
    "transcribe": (4, 20, ["--no-llm", "--responder", "echo"]),
    "talk": (4, 20, ["--no-llm", "--responder", "echo"]),
    "llm": (2, 20, []),
}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its live descendants (the server's ASR workers)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLK
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += tree_cpu_s(int(child))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


def loadtest(target: str, args: list[str]) -> dict:
    with open(os.devnull, "w") as quiet:
        result = subprocess.run([RTMEDIA, "loadtest", "--target", target, "--json", "--quiet", *args],
                                stdout=subprocess.PIPE, stderr=quiet, text=True, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise RuntimeError(f"rtmedia loadtest {' '.join(args)} failed ({result.returncode})")
    return json.loads(result.stdout.splitlines()[-1])


def capacity(profile: str, duration: float) -> dict:
    first, chunk_ms, serve_args = PROFILES[profile]
    with running_server("--metrics-port", "0", "--max-sessions", "3000", "--log-level", "WARNING",
                        *serve_args) as (target, server):
        cpu0, t0 = tree_cpu_s(server.pid), time.perf_counter()
        report = loadtest(target, ["--profile", profile, "--find-capacity", "--sessions", str(first),
                                   "--chunk-ms", str(chunk_ms), "--duration", str(duration),
                                   "--ramp-per-s", "50", "--capacity-limit", "1000"])
        server_share = (tree_cpu_s(server.pid) - cpu0) / (time.perf_counter() - t0) / (os.cpu_count() or 1)
    metric = report["slo"]["metric"]
    return {"profile": profile, "chunk_ms": chunk_ms, "capacity": report["capacity"], "slo_metric": metric,
            "levels": report["capacity_levels"], "server_cpu_share_whole_search": round(server_share, 3),
            "at_capacity": {k: report[k] for k in ("sessions", "loadgen_cpu_share", "response_latency_ms",
                                                   "voice_to_voice_ms", "vad_start_ms", "transcript_final_ms",
                                                   "jitter_ms", "underruns", "errors")}}


def fixed_run(profile: str, sessions: int, duration: float, serve_args: list[str], args: list[str]) -> dict:
    """One loadtest of `sessions` at once on a fresh server; the report and the server's CPU."""
    _, chunk_ms, profile_args = PROFILES.get(profile, PROFILES["talk"])
    with running_server("--metrics-port", "0", "--max-sessions", "3000", "--log-level", "WARNING",
                        *profile_args, *serve_args) as (target, server):
        cpu0, t0 = tree_cpu_s(server.pid), time.perf_counter()
        report = loadtest(target, ["--profile", profile, "--sessions", str(sessions), "--chunk-ms", str(chunk_ms),
                                   "--duration", str(duration), "--ramp-per-s", "50", *args])
        wall, cpu = time.perf_counter() - t0, tree_cpu_s(server.pid) - cpu0
    return {"report": report, "server_cpu_s": round(cpu, 2),
            "server_cpu_per_session_s": round(cpu / wall / sessions, 4)}


def noise_reduction(runs: list[tuple[str, int]], duration: float) -> dict:
    out: dict = {}
    for profile, sessions in runs:
        for kind in ("off", "near_field", "far_field"):
            run = fixed_run(profile, sessions, duration, ["--noise-reduction", kind], [])
            report, metric = run["report"], run["report"]["slo"]["metric"]
            out[f"{profile}:{sessions}:{kind}"] = {
                "server_cpu_per_session_s": run["server_cpu_per_session_s"], metric: report[metric],
                "slo": report["slo"]["verdict"], "errors": report["errors"], "underruns": report["underruns"]}
    return out


def interruptions(sessions: int, duration: float) -> dict:
    out: dict = {}
    for mode in ("immediate", "confirmed"):
        report = fixed_run("barge-in", sessions, duration, [],
                           ["--barge-in-share", "1", "--backchannel-share", "0.4", "--noise", "0.2",
                            "--interruption", mode])["report"]
        out[mode] = {k: report[k] for k in ("voices_over_replies", "replies_cancelled_by", "false_cancels",
                                            "barge_in_ms", "response_latency_ms", "errors", "errors_by_code")}
    return out


# ---- the frame path against a bare servicer ---------------------------------------------------------

def bare_server(port: int) -> None:
    """A RealtimeService.Converse that reads every chunk and does nothing else (plus the
    session.created / session.closed events a client waits for, and health)."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc
    from rtmedia.protocol.events import server_event
    from rtmedia.v1 import realtime_pb2_grpc

    class Bare(realtime_pb2_grpc.RealtimeServiceServicer):
        async def Converse(self, request_iterator, context):
            await context.write(server_event("session.created", session_id="bare"))
            async for request in request_iterator:
                if request.WhichOneof("event") == "session_close":
                    await context.write(server_event("session.closed", reason="client"))
                    return

    async def serve() -> None:
        server = grpc.aio.server()
        realtime_pb2_grpc.add_RealtimeServiceServicer_to_server(Bare(), server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def frame_run(target: str, pid: int, sessions: int, duration: float) -> dict:
    cpu0 = tree_cpu_s(pid)
    report = loadtest(target, ["--profile", "listen", "--turn-detection", "none", "--chunk-ms", "20",
                               "--sessions", str(sessions), "--ramp-per-s", "100", "--duration", str(duration)])
    server_cpu = tree_cpu_s(pid) - cpu0
    frames = report["chunks_sent"]
    return {"sessions": sessions, "frames": int(frames), "server_cpu_s": round(server_cpu, 2),
            "frames_per_server_cpu_s": round(frames / max(server_cpu, 1e-6)),
            "loadgen_cpu_share": report["loadgen_cpu_share"], "loadgen_late_chunks": report["loadgen_late_chunks"],
            "errors": report["errors"], "errors_by_code": report["errors_by_code"]}


def frame_path(sessions: int, duration: float) -> dict:
    port = free_port()
    bare = subprocess.Popen([sys.executable, __file__, "--bare-server", str(port)])
    try:
        wait_serving(f"127.0.0.1:{port}", bare)
        bare_result = frame_run(f"127.0.0.1:{port}", bare.pid, sessions, duration)
    finally:
        bare.terminate()
        bare.wait(timeout=30)
    with running_server("--metrics-port", "0", "--no-llm", "--responder", "echo", "--max-sessions", "3000",
                        "--log-level", "WARNING") as (target, server):
        rtmedia_result = frame_run(target, server.pid, sessions, duration)
    return {"sessions": sessions, "chunk_ms": 20, "duration_s": duration, "bare": bare_result,
            "rtmedia": rtmedia_result,
            "throughput_ratio": round(rtmedia_result["frames_per_server_cpu_s"]
                                      / bare_result["frames_per_server_cpu_s"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", default="listen,transcribe,talk,llm")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per capacity level")
    parser.add_argument("--frame-path", action="store_true", help="also the frame-path overhead benchmark")
    parser.add_argument("--frame-sessions", type=int, default=100)
    parser.add_argument("--noise-reduction", default="", metavar="PROFILE:SESSIONS,...",
                        help="fixed runs with noise reduction off, near_field and far_field")
    parser.add_argument("--interruptions", type=int, default=0, metavar="SESSIONS",
                        help="fixed barge-in runs with backchannels and noise, immediate against confirmed")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--bare-server", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_server is not None:
        bare_server(args.bare_server)
        return
    result: dict = {"benchmark": "loadtest", "machine": machine(), "capacity": {}}
    if args.frame_path:
        result["frame_path"] = frame_path(args.frame_sessions, args.duration)
    for profile in filter(None, args.profiles.split(",")):
        result["capacity"][profile] = capacity(profile, args.duration)
    if args.noise_reduction:
        runs = [(p, int(n)) for p, n in (run.split(":") for run in args.noise_reduction.split(","))]
        result["noise_reduction"] = noise_reduction(runs, args.duration)
    if args.interruptions:
        result["interruptions"] = interruptions(args.interruptions, args.duration)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
