"""What hostile clients cost a real `rtmedia serve` (echo responder, or `--llm`): the server's
resident memory (its process tree) before, at the peak of, and after each attack, and the
sessions, threads and file descriptors left behind.

Attacks, one after the other on one server:
- `big_ids`: a client that never reads sends events whose `event_id` is 2 MiB (each one
  refused with an error that does not echo it);
- `errors`: a client that never reads sends 300,000 small events that are each answered by
  an `error` (a `response.cancel` with nothing to cancel), until the server closes it;
- `empty`: 300,000 empty requests;
- `vanishing`: rounds of 200 clients that open a session, speak, ask for a reply and vanish
  while it is answered (cancelling, closing their connection, or killed with SIGKILL). A
  first round warms the server up (its thread pools grow to their size on first use); the
  baseline is taken after it. The vanishing clients and the /proc readings are shared with
  tests/reliability/ (vanishing.py, resources.py).

    .venv/bin/python tests/perf/bench_hostile.py [--rounds 5] [--llm]

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

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rtmedia.protocol.events import client_event  # noqa: E402
from rtmedia.v1 import realtime_pb2, realtime_pb2_grpc  # noqa: E402

from tests.perf.bench_speech import machine  # noqa: E402
from tests.reliability.resources import rss_mib, tree  # noqa: E402
from tests.reliability.vanishing import speech_audio, vanish_child, vanishing  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402

NON_READING = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024),
               ("grpc.max_send_message_length", 8 * 1024 * 1024)]


METRICS = {"rtmedia_sessions_active": "sessions_active", 'rtmedia_sessions_total{outcome="failed"}': "sessions_failed",
           'rtmedia_lm_slots{state="kept"}': "lm_slots_kept", 'rtmedia_lm_slots{state="busy"}': "lm_slots_busy",
           'rtmedia_lm_slots{state="waiting"}': "lm_waiting"}


def counts(pid: int, metrics_port: int) -> dict:
    """Threads, fds and processes of the server, and its session gauges from /metrics."""
    out: dict = {"threads": len(list(Path(f"/proc/{pid}/task").iterdir())),
                 "fds": len(list(Path(f"/proc/{pid}/fd").iterdir())), "processes": len(tree(pid)),
                 "workers_rss_mib": rss_mib(pid, children_only=True)}  # the ASR workers' decoders
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            name, _, value = line.rpartition(" ")
            if name in METRICS:
                out[METRICS[name]] = float(value)
    return out


async def watch(pid: int, metrics_port: int, attack, *args) -> dict:
    """Run `attack`, sampling the server's RSS every 50 ms; (before, peak, and 2 s after its
    last session ended), and how long after the attack that was."""
    before, peak = rss_mib(pid), 0.0
    task = asyncio.ensure_future(attack(*args))
    started = time.perf_counter()
    while not task.done():
        peak = max(peak, rss_mib(pid))
        await asyncio.sleep(0.05)
    detail = task.result()
    ended = time.perf_counter()
    while counts(pid, metrics_port).get("sessions_active") and time.perf_counter() - ended < 120:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    detail["sessions_released_s"] = round(time.perf_counter() - ended, 1)
    await asyncio.sleep(2)
    after = rss_mib(pid)
    return {**counts(pid, metrics_port), "rss_before_mib": before, "rss_peak_mib": max(peak, after), "rss_after_mib": after,
            "peak_growth_mib": round(max(peak, after) - before, 1), "seconds": round(time.perf_counter() - started, 1),
            **detail}


async def non_reading(target: str, requests, limit_s: float = 60) -> dict:
    async with grpc.aio.insecure_channel(target, options=NON_READING) as channel:
        call = realtime_pb2_grpc.RealtimeServiceStub(channel).Converse(requests)
        try:
            code = await asyncio.wait_for(call.code(), limit_s)
        except TimeoutError:
            call.cancel()
            return {"ended": f"no status at the client within {limit_s:g} s (it reads nothing)"}
        return {"ended": code.name}


async def big_ids(target: str) -> dict:
    async def requests():
        for n in range(500):
            yield client_event("response.cancel", event_id=f"{n:07d}" + "x" * (2 * 1024 * 1024 - 8))
    sent = await non_reading(target, requests())
    return {"events": 500, "uploaded_mib": 1000, **sent}


async def errors(target: str) -> dict:
    async def requests():
        for n in range(300_000):
            yield client_event("response.cancel", event_id=f"{n:0200d}")
            if n % 500 == 0:
                await asyncio.sleep(0)
    return {"events": 300_000, **await non_reading(target, requests())}


async def empty(target: str) -> dict:
    async def requests():
        for n in range(300_000):
            yield realtime_pb2.ConverseRequest()
            if n % 500 == 0:
                await asyncio.sleep(0)
    return {"events": 300_000, **await non_reading(target, requests(), limit_s=10)}


async def run(rounds: int, llm: bool, non_reading_attacks: bool) -> dict:
    metrics_port = free_port()
    audio = speech_audio()
    responder = () if llm else ("--no-llm", "--responder", "echo")
    with running_server("--metrics-port", str(metrics_port), *responder, "--max-sessions", "3000",
                        "--log-level", "WARNING") as (target, server):
        pid = server.pid
        await asyncio.sleep(2)
        result: dict = {"fresh": {"rss_mib": rss_mib(pid), **counts(pid, metrics_port)}}
        if rounds:  # thread pools and caches grow to their working size on first use
            result["warm_up"] = await watch(pid, metrics_port, vanishing, target, audio)
        baseline = result["baseline"] = {"rss_mib": rss_mib(pid), **counts(pid, metrics_port)}
        for name, attack in (("big_ids", big_ids), ("errors", errors), ("empty", empty))[:3 * non_reading_attacks]:
            result[name] = await watch(pid, metrics_port, attack, target)
        result["vanishing"] = []
        for _ in range(rounds):
            result["vanishing"].append(await watch(pid, metrics_port, vanishing, target, audio))
        after = result["after"] = {"rss_mib": rss_mib(pid), **counts(pid, metrics_port)}
        after["rss_vs_baseline"] = round(after["rss_mib"] / baseline["rss_mib"], 3)
        after["rss_vs_first_round"] = round(after["rss_mib"] / result["vanishing"][0]["rss_after_mib"], 3) \
            if rounds else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of 200 vanishing clients")
    parser.add_argument("--llm", action="store_true", help="serve the embedded LM (default: the echo responder)")
    parser.add_argument("--vanishing-only", action="store_true", help="skip the non-reading clients")
    parser.add_argument("--vanish-child", nargs=2, metavar=("TARGET", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vanish_child:
        asyncio.run(vanish_child(args.vanish_child[0], int(args.vanish_child[1])))
        return
    result = asyncio.run(run(args.rounds, args.llm, not args.vanishing_only))
    print(json.dumps({"machine": machine(), **result}, indent=1))


if __name__ == "__main__":
    main()
