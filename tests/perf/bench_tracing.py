"""What OpenTelemetry traces cost: `talk` sessions against a server exporting traces to a local
OTLP sink, beside the same server without tracing, in one sitting.

    .venv/bin/python tests/perf/bench_tracing.py [--sessions 16] [--duration 60] [--rounds 4]
        [--out results.json]

Two `rtmedia serve` processes run at once (the echo responder): one with `--otel-endpoint` at a
sink in this process (a small aiohttp server that takes OTLP/HTTP `POST /v1/traces`, counts the
requests, bytes and spans, and answers as a collector does), one without. The load tester
(`rtmedia loadtest --profile talk`) runs against each in turn, the order alternating by round;
the other server sits idle meanwhile. Each run: the SLO held, voice-to-voice p50, and the server
process tree's CPU per session-second (`tree_cpu_s`); for the traced server, what reached the
sink. The target: tracing costs at most 5 % more CPU per session, and the hold rate is unchanged.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_loadtest import tree_cpu_s  # noqa: E402
from tests.perf.bench_realtime_ws import loadtest, spread  # noqa: E402
from tests.perf.bench_speech import machine, report  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402


class OtlpSink:
    """An OTLP/HTTP trace receiver in a thread of its own: counts what it is sent."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests = self.bytes = self.spans = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(),), daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counts(self) -> dict[str, int]:
        return {"requests": self.requests, "bytes": self.bytes, "spans": self.spans}

    async def _traces(self, request: Any) -> Any:
        from aiohttp import web
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = await request.read()
        export = ExportTraceServiceRequest.FromString(body)
        self.requests += 1
        self.bytes += len(body)
        self.spans += sum(len(scope.spans) for rs in export.resource_spans for scope in rs.scope_spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    async def _serve(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._stop = asyncio.Event()
        self._started.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def one(
    name: str, target: str, pid: int, sessions: int, duration: float, sink: OtlpSink | None
) -> dict[str, Any]:
    before = sink.counts() if sink is not None else None
    cpu0, t0 = tree_cpu_s(pid), time.perf_counter()
    report = loadtest(
        [
            "--target",
            target,
            "--profile",
            "talk",
            "--sessions",
            str(sessions),
            "--duration",
            str(duration),
            "--ramp-per-s",
            "50",
        ]
    )
    cpu, wall = tree_cpu_s(pid) - cpu0, time.perf_counter() - t0
    run: dict[str, Any] = {
        "server": name,
        "sessions": sessions,
        "held": report["slo"]["held"],
        "v2v_p50_ms": report["voice_to_voice_ms"]["p50"],
        "responses": report["responses"],
        "errors": report["errors"],
        "server_cpu_ms_per_session_s": round(cpu / wall / sessions * 1000, 2),
    }
    # (spans of the run's last sessions may follow in the next batch)
    if sink is not None and before is not None:
        run["exported"] = {k: v - before[k] for k, v in sink.counts().items()}
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16, help="talk sessions (16)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per run (60)")
    parser.add_argument("--rounds", type=int, default=4, help="runs per server (4)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {
        "benchmark": "tracing",
        "machine": machine(),
        "sessions": args.sessions,
        "duration_s": args.duration,
    }
    common = (
        "--responder",
        "echo",
        "--max-sessions",
        "3000",
        "--log-level",
        "WARNING",
        "--metrics-port",
        "0",
    )
    with (
        OtlpSink() as sink,
        running_server(*common, "--otel-endpoint", sink.url) as (traced_target, traced),
        running_server(*common) as (plain_target, plain),
    ):
        servers = [("off", plain_target, plain.pid, None), ("traced", traced_target, traced.pid, sink)]
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "traced": []}
        for round_ in range(args.rounds):
            for name, target, pid, to in servers if round_ % 2 == 0 else servers[::-1]:
                run = one(name, target, pid, args.sessions, args.duration, to)
                print(json.dumps(run), file=sys.stderr, flush=True)
                runs[name].append(run)
        result["runs"] = {
            name: {
                "held": f"{sum(r['held'] for r in rs)} of {len(rs)}",
                "v2v_p50_ms": spread([r["v2v_p50_ms"] for r in rs]),
                "server_cpu_ms_per_session_s": spread([r["server_cpu_ms_per_session_s"] for r in rs]),
            }
            for name, rs in runs.items()
        }
        off = result["runs"]["off"]["server_cpu_ms_per_session_s"]["median"]
        on = result["runs"]["traced"]["server_cpu_ms_per_session_s"]["median"]
        result["cpu_increase_pct"] = round((on / off - 1) * 100, 1) if off and on else None
        time.sleep(6)  # the traced server's batch processor exports every 5 s
        result["exported"] = sink.counts()
    report(result, args.out)


if __name__ == "__main__":
    main()
