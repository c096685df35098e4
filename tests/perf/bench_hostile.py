"""What hostile clients cost a real `rtmedia serve` (echo responder, no LM): the server's
resident memory (its process tree) before, at the peak of, and after each attack, and the
sessions, threads and file descriptors left behind.

Attacks, one after the other on one server:
- `big_ids`: a client that never reads sends events whose `event_id` is 2 MiB (each one
  refused with an error that does not echo it);
- `errors`: a client that never reads sends 300,000 small events that are each answered by
  an `error` (a `response.cancel` with nothing to cancel), until the server closes it;
- `empty`: 300,000 empty requests;
- `vanishing`: rounds of 200 clients that open a session, send audio and vanish (cancel).

    .venv/bin/python tests/perf/bench_hostile.py [--rounds 5]

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
from tests.support.serve import free_port, running_server  # noqa: E402

NON_READING = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024),
               ("grpc.max_send_message_length", 8 * 1024 * 1024)]


def tree(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            pids += tree(int(child))
    return pids


def rss_mib(pid: int) -> float:
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return round(total / 1024, 1)


METRICS = {"rtmedia_sessions_active": "sessions_active", 'rtmedia_sessions_total{outcome="failed"}': "sessions_failed",
           'rtmedia_lm_slots{state="kept"}': "lm_slots_kept"}


def counts(pid: int, metrics_port: int) -> dict:
    """Threads, fds and processes of the server, and its session gauges from /metrics."""
    out: dict = {"threads": len(list(Path(f"/proc/{pid}/task").iterdir())),
                 "fds": len(list(Path(f"/proc/{pid}/fd").iterdir())), "processes": len(tree(pid))}
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            name, _, value = line.rpartition(" ")
            if name in METRICS:
                out[METRICS[name]] = float(value)
    return out


async def watch(pid: int, metrics_port: int, attack, *args) -> dict:
    """Run `attack`, sampling the server's RSS every 50 ms; (before, peak, after 2 s)."""
    before, peak = rss_mib(pid), 0.0
    task = asyncio.ensure_future(attack(*args))
    started = time.perf_counter()
    while not task.done():
        peak = max(peak, rss_mib(pid))
        await asyncio.sleep(0.05)
    detail = task.result()
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


async def vanishing(target: str, clients: int = 200) -> dict:
    audio = b"\x10\x00" * 16000
    async with grpc.aio.insecure_channel(target) as channel:
        stub = realtime_pb2_grpc.RealtimeServiceStub(channel)

        async def one(n: int) -> None:
            queue: asyncio.Queue = asyncio.Queue()
            queue.put_nowait(client_event("input_audio_buffer.append", audio=audio))

            async def requests():
                while True:
                    yield await queue.get()

            call = stub.Converse(requests())
            await anext(aiter(call))  # session.created
            await asyncio.sleep(0.01 * (n % 5))
            call.cancel()

        await asyncio.gather(*(one(n) for n in range(clients)), return_exceptions=True)
    return {"clients": clients}


async def run(rounds: int) -> dict:
    metrics_port = free_port()
    with running_server("--metrics-port", str(metrics_port), "--no-llm", "--responder", "echo", "--max-sessions", "3000",
                        "--log-level", "WARNING") as (target, server):
        pid = server.pid
        await asyncio.sleep(2)
        baseline = {"rss_mib": rss_mib(pid), **counts(pid, metrics_port)}
        result: dict = {"baseline": baseline}
        for name, attack in (("big_ids", big_ids), ("errors", errors), ("empty", empty)):
            result[name] = await watch(pid, metrics_port, attack, target)
        result["vanishing"] = []
        for _ in range(rounds):
            result["vanishing"].append(await watch(pid, metrics_port, vanishing, target))
        result["after"] = {"rss_mib": rss_mib(pid), **counts(pid, metrics_port)}
        result["after"]["rss_vs_first_round"] = round(
            result["after"]["rss_mib"] / result["vanishing"][0]["rss_after_mib"], 3) if rounds else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of 200 vanishing clients")
    args = parser.parse_args()
    result = asyncio.run(run(args.rounds))
    print(json.dumps({"machine": machine(), **result}, indent=1))


if __name__ == "__main__":
    main()
