"""How long an in-process server takes to start (echo responder, no LM), its engines loaded at
once (`Scheduler.load`, as the server does) against one after another, alternating, each start
in a fresh process (imports excluded, the on-disk model cache warm as after a first start).

    .venv/bin/python tests/perf/bench_server_start.py [--rounds 2]

Prints one JSON object: the seconds of each start, per way, and their medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time


async def start(sequential: bool) -> float:
    from rtmedia.server.app import RtmediaServer
    from rtmedia.server.config import ServerConfig

    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, llm=False, default_responder="echo", grace_s=1))
    if sequential:
        async def one_after_another() -> None:
            for engine in server.scheduler._engines():
                await asyncio.to_thread(engine.load)
                await asyncio.to_thread(engine.warmup)

        server.scheduler.load = one_after_another
    began = time.perf_counter()
    await server.start()
    seconds = time.perf_counter() - began
    await server.stop(0)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=("at_once", "one_after_another"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(asyncio.run(start(args.one == "one_after_another")))
        return
    runs: dict[str, list[float]] = {"at_once": [], "one_after_another": []}
    for _ in range(args.rounds):
        for way in runs:
            out = subprocess.run([sys.executable, __file__, "--one", way], capture_output=True, text=True, check=True)
            runs[way].append(round(float(out.stdout.split()[-1]), 2))
    print(json.dumps({"seconds": runs, "median": {w: statistics.median(s) for w, s in runs.items()}}))


if __name__ == "__main__":
    main()
