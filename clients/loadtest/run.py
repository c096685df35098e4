"""One level of `rtmedia loadtest`: `Run`, a fixed number of people at once on one link (gRPC
channels or the Realtime WebSocket), ramped up, measured and reported; and `Progress`, its live
view on stderr."""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from rtmedia.clients.commands.common import CliError
from rtmedia.clients.loadtest.person import Person
from rtmedia.clients.loadtest.report import (
    Stats,
    build_report,
    key_latency,
    slo_verdict,
)
from rtmedia.clients.loadtest.settings import (
    MIXED,
    PROFILES,
    input_rate,
    session_config,
)
from rtmedia.clients.loadtest.speech import (
    Clip,
)
from rtmedia.protocol.events import client_event

# ---- one run at a fixed session count -----------------------------------------------------------------

@dataclass
class Run:
    """One level: `sessions` people at once. `link` is what they connect through: the gRPC
    channels, or (openai-ws) a rtmedia.clients.loadtest.openai_ws.SocketLink; `clips` hold
    that transport's append events."""

    args: argparse.Namespace
    link: Any
    clips: list[Clip]
    sessions: int
    stats: Stats = field(init=False)
    silence: Any = field(init=False)
    chunk_ms: int = field(init=False)
    configs: dict[str, dict[str, Any]] = field(init=False)
    person: type[Person] = field(init=False)
    stop_at: float = 0.0
    drain_at: float = 0.0
    failure: str = ""
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.chunk_ms = self.args.chunk_ms
        self.stats = Stats(time.perf_counter())
        self.plain = [c for c in self.clips if c.kind == "speech" and c.pause_ms is None]
        self.paused = [c for c in self.clips if c.pause_ms is not None]  # --paused-share
        self.backchannels = [c for c in self.clips if c.kind == "backchannel"]  # --backchannel-share
        self.noises = [c for c in self.clips if c.kind == "noise"]  # --noise
        silence = bytes(2 * input_rate(self.args) * self.chunk_ms // 1000)
        profiles = [p for p in PROFILES if p != "mixed"]
        if self.args.transport == "openai-ws":
            from rtmedia.clients.loadtest.openai_ws import SocketPerson, api_session, append_event

            self.person, self.silence = SocketPerson, append_event(silence)
            self.configs = {p: api_session(p, self.args) for p in profiles}
        else:
            self.person, self.silence = Person, client_event("input_audio_buffer.append", audio=silence)
            self.configs = {p: session_config(p, self.args) for p in profiles}

    @property
    def where(self) -> str:
        """Where the sessions go: the gRPC target or the WebSocket URL."""
        return str(self.link.url) if self.args.transport == "openai-ws" else str(self.args.target)

    def channel_for(self, index: int) -> grpc.aio.Channel:
        return self.link[index % len(self.link)]

    def fail(self, message: str) -> None:
        if not self.failure:
            self.failure = message
            self.failed.set()

    def profile_of(self, index: int) -> str:
        return MIXED[index % len(MIXED)] if self.args.profile == "mixed" else self.args.profile

    async def go(self, progress: Progress) -> dict[str, Any]:
        args = self.args
        cpu0, origin = _cpu_s(), time.perf_counter()
        self.stats.origin = origin
        self.stop_at = origin + args.duration
        self.drain_at = self.stop_at + max(15.0, args.reply_timeout)
        people = [self.person(self, n, self.profile_of(n)) for n in range(self.sessions)]
        tasks = [asyncio.create_task(p.live(origin + n / args.ramp_per_s), name=f"loadtest-{n}")
                 for n, p in enumerate(people)]
        everyone = asyncio.gather(*tasks)
        failed = asyncio.create_task(self.failed.wait())
        ticker = asyncio.create_task(progress.follow(self), name="loadtest-progress")
        try:
            await asyncio.wait([everyone, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*tasks, failed, ticker):
                task.cancel()
            await asyncio.gather(everyone, failed, ticker, return_exceptions=True)
        if self.failure:
            raise CliError(self.failure)
        await everyone  # a bug in a person surfaces here
        self.stats.tick(time.perf_counter())
        settings = {"profile": args.profile, "sessions": self.sessions, "ramp_per_s": args.ramp_per_s,
                    "duration_s": args.duration, "chunk_ms": self.chunk_ms, "input_rate": input_rate(args),
                    "turn_detection": args.turn_detection, "interruption": args.interruption or "server default",
                    "transport": args.transport, "target": self.where,
                    "audio": str(args.audio) if args.audio else "built-in Piper sentences"}
        report = build_report(self.stats, settings, time.perf_counter() - origin, _cpu_s() - cpu0,
                              os.cpu_count() or 1, [p.summary() for p in people])
        held, verdict = slo_verdict(report, args.slo_p95_ms)
        report["slo"] = {"metric": key_latency(args.profile), "p95_ms": args.slo_p95_ms, "held": held,
                         "verdict": verdict}
        return report


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Progress:
    """Live progress: a rich table on a terminal, else a line every 5 s on stderr."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.label = ""

    async def follow(self, run: Run) -> None:
        live = None
        if not self.quiet and self.tty:
            from rich.console import Console
            from rich.live import Live

            live = Live(console=Console(stderr=True), refresh_per_second=2, transient=True)
            live.start()
        try:
            n = 0
            while True:
                await asyncio.sleep(1.0)
                point = run.stats.tick(time.perf_counter())
                n += 1
                if live is not None:
                    live.update(self.table(point, run))
                elif not self.quiet and n % 5 == 0:
                    print(self.line(point, run), file=sys.stderr, flush=True)
        finally:
            if live is not None:
                live.stop()

    def line(self, point: dict[str, Any], run: Run) -> str:
        def ms(metric: str) -> str:
            return "-" if point[metric]["p95"] is None else f"{point[metric]['p95']:.0f}"

        return (f"{self.label}t={point['t_s']:.0f}s active {point['active']}/{run.sessions} "
                f"rejected {point['rejected']} errors {point['errors']} underruns {point['underruns']} "
                f"p95 ms (last 5 s): response {ms('response_latency_ms')} vad {ms('vad_start_ms')} "
                f"transcript {ms('transcript_final_ms')}")

    def table(self, point: dict[str, Any], run: Run) -> Any:
        from rich.table import Table

        table = Table(title=f"{self.label}rtmedia loadtest: {run.args.profile} at {run.where}, "
                            f"{point['t_s']:.0f} s", title_justify="left")
        for col in ("active", "started", "rejected", "errors", "underruns", "late chunks"):
            table.add_column(col, justify="right")
        table.add_row(f"{point['active']}/{run.sessions}", str(point["started"]), str(point["rejected"]),
                      str(point["errors"]), str(point["underruns"]), str(run.stats.late_chunks))
        lat = Table(title="last 5 s (ms)", title_justify="left")
        for col in ("latency", "p50", "p95"):
            lat.add_column(col, justify="right")
        for metric in ("response_latency_ms", "vad_start_ms", "transcript_final_ms"):
            s = point[metric]
            lat.add_row(metric.removesuffix("_ms"), *("-" if s[q] is None else f"{s[q]:.0f}" for q in ("p50", "p95")))
        from rich.console import Group

        return Group(table, lat)
