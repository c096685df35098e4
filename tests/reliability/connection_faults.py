"""Connection faults against a real `rtmedia serve`: storms of clients that vanish mid-stream,
slow readers and clients that stop sending without closing, then a check that every resource
of the server is back where it was.

Each round runs at once:
- `--clients` vanishing clients (tests/reliability/vanishing.py): each speaks a real sentence,
  asks for a reply and vanishes while it speaks or is answered; a third cancel their call, a
  third close their own connection, a third live in a child process killed with SIGKILL;
- `--slow-readers` clients that keep speaking at real-time pace and ask for replies, but read
  one event a second (on a connection with a small read-ahead window, so the server feels it),
  and go after `--slow-read-s`;
- `--silent` clients that stop sending without closing their stream, half of them in the
  middle of an utterance and half after a reply; each asked for `idle_timeout_s`
  `--idle-timeout-s`, so the server's idle timeout must close them
  (`session.closed{idle_timeout}`, then status OK).

A first round warms the server up (thread pools and decoder pools grow to their working size
on first use); the baseline is taken after it, once the server is quiet and a heap trim of its
housekeeping has run. After every round the server gets `--settle-s` to return to it, and
tests/reliability/resources.py names whatever did not: sessions, LM slots by state, lane
queues, the ASR workers' gauges, and the threads, file descriptors and resident memory of the
main process and of each worker process.

    .venv/bin/python tests/reliability/connection_faults.py --clients 500 --rounds 5 [--llm]

Prints one JSON object; exits 1 when something did not return or a silent client was not
closed by its idle timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rtmedia.protocol.events import client_event  # noqa: E402
from rtmedia.v1 import realtime_pb2_grpc  # noqa: E402

from tests.perf.bench_speech import machine  # noqa: E402
from tests.reliability.resources import (  # noqa: E402
    Snapshot,
    Tolerances,
    add_settle_flags,
    quiet,
    scrape,
    settle,
    snapshot,
    tolerances_of,
)
from tests.reliability.vanishing import (  # noqa: E402
    CHUNK_BYTES,
    RATE,
    from_queue,
    speaking_events,
    speaking_requests,
    speech_audio,
    vanishing,
)
from tests.support.serve import free_port, running_server  # noqa: E402

# A reader that reads little: no adaptive window, a small read-ahead, so what the client does
# not read backs up into the server's outbox instead of the client's buffers.
SLOW_READER_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
BASELINE_WAIT_S = 12.0  # longer than the housekeeping's heap-trim period
SILENCE = bytes(CHUNK_BYTES)


@dataclass(frozen=True)
class Attack:
    """One round's clients."""

    clients: int = 500
    slow_readers: int = 10
    slow_read_s: float = 10.0
    silent: int = 10
    idle_timeout_s: int = 2


async def slow_reader(target: str, audio: bytes, read_s: float) -> dict[str, Any]:
    """Speaks the sentence and asks for a reply, then keeps speaking it at real-time pace with
    pauses (each turn answered), reading one event a second; cancels its call after `read_s`."""
    async with grpc.aio.insecure_channel(target, options=SLOW_READER_OPTIONS) as channel:
        queue = speaking_requests(audio)
        call = realtime_pb2_grpc.RealtimeServiceStub(channel).Converse(from_queue(queue))

        async def speak() -> None:
            while True:
                for at in range(0, len(audio), CHUNK_BYTES):
                    queue.put_nowait(client_event("input_audio_buffer.append", audio=audio[at:at + CHUNK_BYTES]))
                    await asyncio.sleep(CHUNK_BYTES / 2 / RATE)
                for _ in range(20):
                    queue.put_nowait(client_event("input_audio_buffer.append", audio=SILENCE))
                    await asyncio.sleep(CHUNK_BYTES / 2 / RATE)

        speaker = asyncio.create_task(speak())
        read, ended = 0, "cancelled by the client"
        deadline = time.monotonic() + read_s
        try:
            events = aiter(call)
            while time.monotonic() < deadline:
                try:
                    await anext(events)
                except StopAsyncIteration:
                    ended = (await call.code()).name
                    break
                read += 1
                await asyncio.sleep(1.0)
        except grpc.aio.AioRpcError as exc:
            ended = exc.code().name
        finally:
            speaker.cancel()
            call.cancel()
        return {"events_read": read, "ended": ended}


async def silent_client(target: str, audio: bytes, n: int, idle_timeout_s: int) -> dict[str, Any]:
    """Stops sending without closing its stream: mid-utterance (even `n`) or after asking for
    a reply (odd `n`). Reads everything until the server closes it."""
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(client_event("session.update", session={"input_audio_format": {"sample_rate": RATE},
                                                             "idle_timeout_s": idle_timeout_s}))
    if n % 2 == 0:
        half = len(audio) // 2 // CHUNK_BYTES * CHUNK_BYTES
        for at in range(0, half, CHUNK_BYTES):
            queue.put_nowait(client_event("input_audio_buffer.append", audio=audio[at:at + CHUNK_BYTES]))
    else:
        for request in speaking_events(audio)[1:]:  # its own session.update went first
            queue.put_nowait(request)
    started = time.monotonic()
    reason, code = "", ""
    async with grpc.aio.insecure_channel(target) as channel:
        call = realtime_pb2_grpc.RealtimeServiceStub(channel).Converse(from_queue(queue))
        try:
            async with asyncio.timeout(idle_timeout_s + 90):
                async for event in call:
                    if event.WhichOneof("event") == "session_closed":
                        reason = event.session_closed.reason
                code = (await call.code()).name
        except TimeoutError:
            call.cancel()
            code = "no end from the server"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
    return {"stopped": "mid_utterance" if n % 2 == 0 else "after_reply", "closed": reason, "code": code,
            "after_s": round(time.monotonic() - started, 1)}


async def peak_sessions(metrics_port: int, done: asyncio.Event) -> float:
    """The most sessions open at once at the server until `done`."""
    peak = 0.0
    while not done.is_set():
        gauges = await asyncio.to_thread(scrape, metrics_port)
        peak = max(peak, gauges.get("rtmedia_sessions_active", 0.0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 0.2)
    return peak


async def attack_round(target: str, metrics_port: int, audio: bytes, attack: Attack) -> dict[str, Any]:
    """One round of every kind of client at once."""
    started = time.monotonic()
    done = asyncio.Event()
    watcher = asyncio.create_task(peak_sessions(metrics_port, done))
    try:
        vanished, slow, silent = await asyncio.gather(
            vanishing(target, audio, attack.clients),
            asyncio.gather(*(slow_reader(target, audio, attack.slow_read_s) for _ in range(attack.slow_readers))),
            asyncio.gather(*(silent_client(target, audio, n, attack.idle_timeout_s) for n in range(attack.silent))))
    finally:
        done.set()
        peak = await watcher
        gc.collect()  # closes the connections of the closed channels (see vanishing.vanishing)
    not_idle_closed = [s for s in silent if (s["closed"], s["code"]) != ("idle_timeout", "OK")]
    return {"peak_sessions": peak, "vanishing": vanished,
            "slow_readers": {"clients": len(slow), "events_read": sum(s["events_read"] for s in slow),
                             "ended": sorted({s["ended"] for s in slow})},
            "silent": {"clients": len(silent), "closed_by_idle_timeout": len(silent) - len(not_idle_closed),
                       "closed_after_s_max": max((s["after_s"] for s in silent), default=None),
                       "not_closed_by_idle_timeout": not_idle_closed},
            "seconds": round(time.monotonic() - started, 1)}


def compact(snap: Snapshot) -> dict[str, Any]:
    return {"processes": {name: {"rss_mib": p.rss_mib, "threads": p.threads, "fds": p.fds}
                          for name, p in snap.processes.items()},
            "tree_rss_mib": snap.tree_rss_mib, "gauges": {k: v for k, v in sorted(snap.gauges.items()) if v}}


async def run(rounds: int, attack: Attack, llm: bool = False, settle_s: float = 60.0,
              tolerances: Tolerances | None = None, server_log: Path | None = None) -> dict[str, Any]:
    """The whole run on one fresh server: {fresh, warm_up, baseline, rounds, after, ok, problems}."""
    tolerances = tolerances or Tolerances()
    metrics_port = free_port()
    audio = speech_audio()
    responder = () if llm else ("--no-llm", "--responder", "echo")
    max_sessions = max(3000, 2 * (attack.clients + attack.slow_readers + attack.silent))
    result: dict[str, Any] = {"machine": machine(), "settings": {
        "rounds": rounds, **attack.__dict__, "llm": llm, "settle_s": settle_s, "tolerances": tolerances.__dict__}}
    with running_server("--metrics-port", str(metrics_port), *responder, "--max-sessions", str(max_sessions),
                        "--log-level", "WARNING", log=server_log) as (target, server):
        pid = server.pid
        await asyncio.sleep(2)
        result["fresh"] = compact(snapshot(pid, metrics_port))
        result["warm_up"] = await attack_round(target, metrics_port, audio, attack)
        problems: list[str] = []
        result["warm_up"]["released_s"], still = await quiet(metrics_port, settle_s)
        if still:
            problems.append(f"the warm-up round left the server busy after {settle_s:g} s: {still}")
        await asyncio.sleep(BASELINE_WAIT_S)
        baseline = snapshot(pid, metrics_port)
        result["baseline"] = baseline.to_json()
        result["rounds"] = []
        for n in range(rounds):
            detail = await attack_round(target, metrics_port, audio, attack)
            detail["released_s"], _ = await quiet(metrics_port, settle_s)
            after, differences, waited = await settle(pid, metrics_port, baseline, tolerances, settle_s)
            detail.update(settled_s=waited, not_returned=differences, after=compact(after))
            result["rounds"].append(detail)
            if differences:
                problems.append(f"round {n + 1}: not back at the baseline after {waited:g} s: "
                                + ", ".join(f"{k} {v['baseline']} -> {v['now']}" for k, v in differences.items()))
            if detail["silent"]["not_closed_by_idle_timeout"]:
                problems.append(f"round {n + 1}: {len(detail['silent']['not_closed_by_idle_timeout'])} silent "
                                "clients were not closed by their idle timeout")
        last = snapshot(pid, metrics_port)
        result["after"] = last.to_json()
        result["after"]["rss_vs_baseline"] = {name: round(p.rss_mib / baseline.processes[name].rss_mib, 3)
                                              for name, p in last.processes.items() if name in baseline.processes}
        if server.poll() is not None:
            problems.append(f"the server exited with {server.returncode}")
    result["ok"], result["problems"] = not problems, problems
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--clients", type=int, default=500, help="vanishing clients per round (default 500)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds after the warm-up round (default 5)")
    parser.add_argument("--slow-readers", type=int, default=10, help="slow readers per round (default 10)")
    parser.add_argument("--slow-read-s", type=float, default=10.0,
                        help="seconds a slow reader reads before it goes (default 10)")
    parser.add_argument("--silent", type=int, default=10,
                        help="clients per round that stop sending without closing (default 10)")
    parser.add_argument("--idle-timeout-s", type=int, default=2,
                        help="the idle_timeout_s the silent clients ask for (default 2)")
    parser.add_argument("--llm", action="store_true", help="serve the embedded LM (KV slots); default: echo")
    add_settle_flags(parser, "a round")
    args = parser.parse_args()
    for name in ("clients", "slow_readers", "silent"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.idle_timeout_s < 1:
        parser.error(f"--idle-timeout-s must be at least 1, got {args.idle_timeout_s}")
    attack = Attack(args.clients, args.slow_readers, args.slow_read_s, args.silent, args.idle_timeout_s)
    result = asyncio.run(run(args.rounds, attack, args.llm, args.settle_s,
                             tolerances_of(args), args.server_log))
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
