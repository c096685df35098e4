"""What the typed client costs the load tester: `rtmedia loadtest --profile listen` at 100
sessions on `RealtimeSession` and its typed events (as the load tester runs) against the same
load tester reading the bare Converse stream of `RealtimeClient` (ConverseResponse messages,
dispatched on their oneof member: how it read before the typed client), alternating, in one
sitting.

    .venv/bin/python tests/perf/bench_client_events.py [--sessions 100] [--duration 40] [--rounds 4]
        [--settle 3] [--out results.json]

One `rtmedia serve --no-llm --responder echo` process serves every run. Each run is a
separate load-tester process (`--child typed|bare` of this file), so each reports its own CPU
(`loadgen_cpu_s`, getrusage of its process); `typed` goes first in even rounds, `bare` in odd
ones, after one warm-up run that is not counted (the first run of a sitting costs more). Reported: per run the load generator's CPU seconds and CPU ms per session-second, and
the ratio typed / bare per round, their median and the ratio of the medians. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.serve import running_server  # noqa: E402

SERVE = ("--no-llm", "--responder", "echo", "--metrics-port", "0", "--max-sessions", "3000", "--log-level", "WARNING")
VARIANTS = ("typed", "bare")


def bare_person() -> type:
    """The load tester's Person reading the bare stream: RealtimeClient's Converse call."""
    import grpc
    from rtmedia.clients.loadtest import person as loadtest
    from rtmedia.clients.loadtest.settings import CLOSE_WAIT_S
    from rtmedia.protocol.events import client_event
    from rtmedia.v1.realtime_pb2_grpc import RealtimeServiceStub

    class BarePerson(loadtest.Person):
        async def open(self) -> bool:
            self.call = RealtimeServiceStub(self.run.channel_for(self.index)).Converse()
            return True

        async def stop_reader(self, reader: asyncio.Task[None]) -> None:
            if not reader.done() and not self.call.done():
                self.cancelled = True
                self.call.cancel()
            await asyncio.gather(reader, return_exceptions=True)

        async def end(self, reader: asyncio.Task[None]) -> None:
            await self.call.write(client_event("session.close"))
            await self.call.done_writing()
            await asyncio.wait_for(asyncio.shield(reader), CLOSE_WAIT_S)

        async def send(self, msg: Any) -> None:
            await self.call.write(msg)

        async def read(self) -> None:
            try:
                async for msg in self.call:
                    kind = msg.WhichOneof("event")
                    self.dispatch(kind, getattr(msg, kind) if kind else None, time.perf_counter())
                if self.closed_reason == "client":
                    self.stats.completed += 1
                else:
                    self.error(f"closed:{self.closed_reason or 'no_session_closed'}")
            except grpc.aio.AioRpcError as exc:
                if not self.cancelled:
                    self.error(f"grpc:{exc.code().name}")
            finally:
                self.ended = True
                self.opened.set()

    return BarePerson


def child(variant: str, argv: list[str]) -> int:
    from rtmedia.clients.loadtest import run as loadtest
    from rtmedia.server.cli import main

    if variant == "bare":
        loadtest.Person = bare_person()  # type: ignore[misc]  # Run picks the class up by name
    return main(["loadtest", *argv])


def run(variant: str, target: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", variant, "--", "--profile", "listen", "--sessions",
               str(args.sessions), "--duration", str(args.duration), "--ramp-per-s", "50", "--target", target,
               "--json", "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        said = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{variant} load tester failed ({result.returncode}): {said}")
    report = json.loads(result.stdout.splitlines()[-1])
    session_s = args.sessions * report["wall_s"]
    return {"variant": variant, "loadgen_cpu_s": report["loadgen_cpu_s"], "wall_s": report["wall_s"],
            "cpu_ms_per_session_s": round(report["loadgen_cpu_s"] * 1000 / session_s, 3),
            "errors": report["errors"], "sessions_completed": report["sessions_completed"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        return child(args.child, [a for a in rest if a != "--"])
    runs: list[dict[str, Any]] = []
    with running_server(*SERVE) as (target, _):
        run("bare", target, args)  # discarded: a sitting's first run costs more, whichever variant it is
        for n in range(args.rounds):
            for variant in VARIANTS if n % 2 == 0 else VARIANTS[::-1]:
                time.sleep(args.settle)
                runs.append({"round": n, **run(variant, target, args)})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    cost = {v: [r["cpu_ms_per_session_s"] for r in runs if r["variant"] == v] for v in VARIANTS}
    per_round = [cost["typed"][n] / cost["bare"][n] for n in range(args.rounds)]
    result = {
        "benchmark": "client_events", "machine": machine(), "sessions": args.sessions,
        "duration_s": args.duration, "rounds": args.rounds, "runs": runs,
        "cpu_ms_per_session_s": {v: {"median": round(statistics.median(c), 3), "min": min(c), "max": max(c)}
                                 for v, c in cost.items()},
        "typed_over_bare": {"per_round": [round(r, 3) for r in per_round],
                            "median": round(statistics.median(per_round), 3),
                            "of_medians": round(statistics.median(cost["typed"]) / statistics.median(cost["bare"]),
                                                3)},
        "target": "typed / bare <= 1.05",
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
