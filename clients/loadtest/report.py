"""What `rtmedia loadtest` measured: percentiles, the report, the SLO check, the
capacity search, the end-of-run table and the PNG chart.

Pure functions over plain numbers, so they are tested without a server.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Every report has these, each with p50/p95/p99/max/count (ms).
LATENCIES = ("response_latency_ms", "voice_to_voice_ms", "barge_in_ms", "vad_start_ms", "transcript_final_ms",
             "jitter_ms")
# The server's response.timings (docs/protocol.md#response-timings), from each response.done.
SERVER_STAGES = ("turn_detection_ms", "transcription_ms", "first_text_ms", "first_audio_ms", "voice_to_voice_ms")
VOICE_KINDS = ("speech", "backchannel", "noise")  # what a barge-in session says over replies
TIMELINE_WINDOW_S = 5.0  # the chart's latency percentiles are over the last 5 s


def latency_summary(values: Iterable[float]) -> dict[str, float | int | None]:
    """p50/p95/p99/max (linear interpolation, 0.1 ms) and count; None when there are no values."""
    data = np.asarray(list(values), dtype=np.float64)
    if not data.size:
        return {"p50": None, "p95": None, "p99": None, "max": None, "count": 0}
    p50, p95, p99, top = np.percentile(data, [50, 95, 99, 100])
    return {"p50": round(float(p50), 1), "p95": round(float(p95), 1), "p99": round(float(p99), 1),
            "max": round(float(top), 1), "count": int(data.size)}


@dataclass
class Stats:
    """Everything the simulated people record during one run (on the event loop)."""

    origin: float  # perf_counter at the start of the run
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: {k: [] for k in LATENCIES})
    errors: Counter[str] = field(default_factory=Counter)
    underruns: int = 0
    started: int = 0
    completed: int = 0
    rejected: int = 0
    active: int = 0
    turns: int = 0
    paused_turns: int = 0  # utterances spoken with a pause mid-sentence (--paused-share)
    premature_turn_ends: int = 0  # of them, those whose turn ended in the pause
    responses: int = 0
    chunks: int = 0  # append events sent
    late_chunks: int = 0  # chunks the load generator sent more than one chunk late
    max_send_lag_ms: float = 0.0
    over: Counter[str] = field(default_factory=Counter)  # voices said over a reply, by kind (barge-in)
    cancelled: Counter[str] = field(default_factory=Counter)  # of them, those whose reply was cancelled
    timeline: list[dict[str, Any]] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SERVER_STAGES})
    preemptive: int = 0  # responses whose timings say they were prepared at a pause (committed)

    def record(self, metric: str, value_s: float, now: float) -> None:
        self.samples[metric].append((now - self.origin, value_s * 1000))

    def record_timings(self, timings: dict[str, Any]) -> None:
        """A response.done's timings (only responses that reached their first audio)."""
        if "voice_to_voice_ms" not in timings:
            return
        for name in SERVER_STAGES:
            if name in timings:
                self.stages[name].append(float(timings[name]))
        self.preemptive += timings.get("preemptive") == "committed"

    def error(self, code: str) -> None:
        self.errors[code] += 1

    def recent(self, metric: str, now_t: float, window_s: float = TIMELINE_WINDOW_S) -> list[float]:
        values = []
        for t, v in reversed(self.samples[metric]):
            if t < now_t - window_s:
                break
            values.append(v)
        return values

    def tick(self, now: float) -> dict[str, Any]:
        """One timeline point: the state now and the last window's latency percentiles."""
        t = now - self.origin
        point: dict[str, Any] = {"t_s": round(t, 2), "active": self.active, "started": self.started,
                                 "rejected": self.rejected, "errors": sum(self.errors.values()),
                                 "underruns": self.underruns}
        for metric in ("response_latency_ms", "vad_start_ms", "transcript_final_ms"):
            recent = self.recent(metric, t)
            s = latency_summary(recent)
            point[metric] = {"p50": s["p50"], "p95": s["p95"]}
        self.timeline.append(point)
        return point


def build_report(stats: Stats, settings: dict[str, Any], wall_s: float, cpu_s: float, cores: int,
                 per_session: list[dict[str, Any]]) -> dict[str, Any]:
    report: dict[str, Any] = {
        **settings,
        "wall_s": round(wall_s, 2),
        "sessions_started": stats.started,
        "sessions_completed": stats.completed,
        "sessions_rejected": stats.rejected,
        "turns": stats.turns,
        "paused_turns": stats.paused_turns,
        "premature_turn_ends": stats.premature_turn_ends,
        "responses": stats.responses,
        "voices_over_replies": {k: stats.over[k] for k in VOICE_KINDS},
        "replies_cancelled_by": {k: stats.cancelled[k] for k in VOICE_KINDS},
        "false_cancels": stats.cancelled["backchannel"] + stats.cancelled["noise"],
        "chunks_sent": stats.chunks,
        "errors": sum(stats.errors.values()),
        "errors_by_code": dict(sorted(stats.errors.items())),
        "underruns": stats.underruns,
        "loadgen_cpu_s": round(cpu_s, 2),
        "loadgen_cpu_share": round(cpu_s / (wall_s * cores), 3) if wall_s > 0 else 0.0,
        "cores": cores,
        "loadgen_late_chunks": stats.late_chunks,
        "loadgen_max_send_lag_ms": round(stats.max_send_lag_ms, 1),
    }
    for metric in LATENCIES:
        report[metric] = latency_summary(v for _, v in stats.samples[metric])
    report["server_stages_ms"] = {name: latency_summary(stats.stages[name]) for name in SERVER_STAGES}
    report["preemptive_committed"] = stats.preemptive
    report["timeline"] = stats.timeline
    report["per_session"] = per_session
    return report


# ---- the SLO and the capacity search ------------------------------------------------------------------

def key_latency(profile: str) -> str:
    """The latency a profile's SLO is on: response latency where there are responses,
    VAD start (listen) or final transcript (transcribe) where there are none."""
    return {"listen": "vad_start_ms", "transcribe": "transcript_final_ms"}.get(profile, "response_latency_ms")


def slo_verdict(report: dict[str, Any], p95_ms: float) -> tuple[bool, str]:
    """Whether a run held the SLO: the key latency's p95 within p95_ms, no underruns,
    no errors, nobody rejected, every session completed, and something measured."""
    metric = key_latency(report["profile"])
    summary = report[metric]
    problems = []
    if not summary["count"]:
        problems.append(f"no {metric} measured")
    elif summary["p95"] > p95_ms:
        problems.append(f"{metric} p95 {summary['p95']:.0f} > {p95_ms:g}")
    if report["underruns"]:
        problems.append(f"{report['underruns']} underruns")
    if report["errors"]:
        codes = ", ".join(f"{k}: {v}" for k, v in report["errors_by_code"].items())
        problems.append(f"{report['errors']} errors ({codes})")
    if report["sessions_rejected"]:
        problems.append(f"{report['sessions_rejected']} sessions rejected")
    unfinished = report["sessions_started"] - report["sessions_rejected"] - report["sessions_completed"]
    if unfinished > 0:
        problems.append(f"{unfinished} admitted sessions did not complete")
    return not problems, "; ".join(problems) or "held"


def next_level(results: dict[int, bool], start: int, growth: float, resolution: float,
               limit: int) -> int | None:
    """The next session count to try: grow by `growth` from `start` while the SLO holds
    (up to `limit`); after the first break, bisect between the largest level that held
    and the smallest that broke until they are within `resolution` (a fraction) of each
    other. None when done."""
    if not results:
        return start
    held = [n for n, ok in results.items() if ok]
    broke = [n for n, ok in results.items() if not ok]
    best = max(held, default=0)
    if not broke:
        if best >= limit:
            return None
        return min(limit, max(best + 1, math.ceil(best * growth)))
    worst = min(broke)
    if worst <= best + 1 or worst - best <= resolution * worst or worst <= 1:
        return None
    return (best + worst) // 2 if best else max(1, worst // 2)


def capacity(results: dict[int, bool]) -> int:
    """The largest level that held below the smallest that broke (0 if none held)."""
    worst = min((n for n, ok in results.items() if not ok), default=math.inf)
    return max((n for n, ok in results.items() if ok and n < worst), default=0)


# ---- output -----------------------------------------------------------------------------------------------

def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render_table(report: dict[str, Any]) -> Any:
    """The end-of-run table (a rich renderable)."""
    from rich.table import Table

    table = Table(title=f"{report['profile']}: {report['sessions']} sessions, {report['chunk_ms']} ms chunks, "
                        f"{report['wall_s']:.0f} s", title_justify="left")
    table.add_column("latency (ms)")
    for col in ("p50", "p95", "p99", "max", "count"):
        table.add_column(col, justify="right")
    for metric in LATENCIES:
        s = report[metric]
        table.add_row(metric.removesuffix("_ms"), _ms(s["p50"]), _ms(s["p95"]), _ms(s["p99"]), _ms(s["max"]),
                      str(s["count"]))
    return table


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"sessions: {report['sessions_started']} started, {report['sessions_completed']} completed, "
             f"{report['sessions_rejected']} rejected; turns {report['turns']}, responses {report['responses']}",
             f"errors: {report['errors']}"
             + (f" ({', '.join(f'{k}: {v}' for k, v in report['errors_by_code'].items())})" if report["errors"] else "")
             + f"; underruns: {report['underruns']}",
             f"load generator: {report['loadgen_cpu_s']:.1f} CPU s = {report['loadgen_cpu_share'] * 100:.0f}% of "
             f"{report['cores']} cores; {report['loadgen_late_chunks']} chunks sent late "
             f"(max lag {report['loadgen_max_send_lag_ms']:.0f} ms)"]
    over, cancelled = report["voices_over_replies"], report["replies_cancelled_by"]
    if any(over.values()):
        lines.append("over replies: " + ", ".join(f"{cancelled[k]} of {over[k]} {k} cancelled" for k in VOICE_KINDS
                                                  if over[k]) + f"; false cancels: {report['false_cancels']}")
    stages = report.get("server_stages_ms") or {}
    if stages.get("voice_to_voice_ms", {}).get("count"):
        lines.append("server stages p50 / p95 (ms): " + ", ".join(
            f"{name.removesuffix('_ms')} {_ms(stages[name]['p50'])} / {_ms(stages[name]['p95'])}" for name in SERVER_STAGES)
            + f"; {report['preemptive_committed']} of {stages['voice_to_voice_ms']['count']} prepared at a pause")
    if "slo" in report:
        lines.append(f"SLO ({report['slo']['metric']} p95 <= {report['slo']['p95_ms']:g} ms, no underruns, "
                     f"no errors): {report['slo']['verdict']}")
    return lines


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Latency percentiles (last 5 s) and active sessions over time, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    timeline: Sequence[dict[str, Any]] = report["timeline"]
    t = [p["t_s"] for p in timeline]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=[2, 1])
    try:
        for metric, label in (("response_latency_ms", "response"), ("vad_start_ms", "VAD start"),
                              ("transcript_final_ms", "final transcript")):
            for q, style in (("p50", "-"), ("p95", "--")):
                values = [math.nan if p[metric][q] is None else p[metric][q] for p in timeline]
                if any(not math.isnan(v) for v in values):
                    top.plot(t, values, style, label=f"{label} {q}")
        top.set_ylabel(f"latency (ms, last {TIMELINE_WINDOW_S:g} s)")
        top.set_title(f"rtmedia loadtest: {report['profile']}, {report['sessions']} sessions, "
                      f"{report['chunk_ms']} ms chunks")
        top.grid(alpha=0.3)
        if top.lines:
            top.legend(loc="upper left", fontsize="small")
        bottom.plot(t, [p["active"] for p in timeline], label="active sessions")
        errors = [p["errors"] for p in timeline]
        if any(errors):
            bottom.plot(t, errors, label="errors (cumulative)", color="tab:red")
        bottom.set_xlabel("time (s)")
        bottom.set_ylabel("sessions")
        bottom.grid(alpha=0.3)
        bottom.legend(loc="upper left", fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
