"""What a running `rtmedia serve` holds, and whether it is back where it was.

A snapshot reads /proc for the server's main process and for each of its child processes
separately (the ASR workers, multiprocessing's resource tracker): resident memory, threads and
open file descriptors; and the server's /metrics: open and draining sessions, LM KV-cache slots
by state, every lane's queue depth and every `rtmedia_asr_*` gauge of a resource (the ASR
workers' streams and decoders), whatever labels they carry.

`compare` holds a snapshot against a baseline and names what did not return:
- gauges and the set of processes must be exactly as at the baseline;
- file descriptors too, in the main process and in each worker;
- threads may differ by `Tolerances.thread_slack` in the main process (gRPC's and the
  executors' pools start threads on demand and keep some of them; a leak grows with every
  round, which is what repeated rounds catch) and must be exact in the workers;
- resident memory is a ratio to the baseline's, per process (a heap that fragments a little
  is not a leak; one that keeps every closed session's state is).

`settle` polls until nothing differs or a deadline passes, since a vanished client's
session is freed only once the server notices its stream is gone.

Shared by the long-run commands (connection_faults.py, soak.py, tests/perf/bench_hostile.py)
and their quick tests.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# The gauges of /metrics a snapshot keeps: by exact name, and by prefix.
GAUGES = ("rtmedia_sessions_active", "rtmedia_sessions_draining", "rtmedia_lm_slots", "rtmedia_lane_queue_depth",
          "rtmedia_token_sessions_active")
GAUGE_PREFIXES = ("rtmedia_asr_",)
# Kept-prefix gauges that hold a setting rather than a resource (the partial-decode cadence
# adapts to load), so they need not return to the baseline.
NOT_RESOURCES = ("rtmedia_asr_partial_cadence_ms",)


def tree(pid: int) -> list[int]:
    """`pid` and its descendants, parents before children."""
    pids = [pid]
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return pids
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for child in children:
            pids += tree(int(child))
    return pids


def rss_mib(pid: int, children_only: bool = False) -> float:
    """Resident memory of `pid`'s process tree (or of its descendants only), in MiB."""
    total = 0
    for p in tree(pid)[1:] if children_only else tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return round(total / 1024, 1)


def role(pid: int) -> str:
    """What a process of the server's tree is, from its command line."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return "gone"
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    if "multiprocessing" in cmdline or "spawn_main" in cmdline:
        return "worker"
    return "process"


@dataclass
class ProcessResources:
    pid: int
    role: str
    rss_mib: float
    threads: int
    fds: int


def process_resources(pid: int, role_: str) -> ProcessResources | None:
    """RSS, threads and open fds of one process; None when it is gone."""
    try:
        rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS:"))
        threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None
    return ProcessResources(pid, role_, round(rss_kib / 1024, 1), threads, fds)


def scrape(metrics_port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """The kept gauges of the server's /metrics, keyed `name{label="value",...}`."""
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "gauge" or not (family.name in GAUGES or family.name.startswith(GAUGE_PREFIXES)) \
                or family.name in NOT_RESOURCES:
            continue
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            gauges[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return gauges


@dataclass
class Snapshot:
    """One look at the server: its processes (main first, then children by pid) and its gauges."""

    processes: dict[str, ProcessResources]  # "main", "worker0", "worker1", ..., "resource_tracker"
    gauges: dict[str, float]
    t: float = field(default_factory=time.monotonic)

    @property
    def main(self) -> ProcessResources:
        return self.processes["main"]

    @property
    def workers_rss_mib(self) -> float:
        return round(sum(p.rss_mib for name, p in self.processes.items() if name.startswith("worker")), 1)

    @property
    def tree_rss_mib(self) -> float:
        return round(sum(p.rss_mib for p in self.processes.values()), 1)

    def to_json(self) -> dict[str, Any]:
        return {"processes": {name: asdict(p) for name, p in self.processes.items()},
                "process_count": len(self.processes), "tree_rss_mib": self.tree_rss_mib,
                "workers_rss_mib": self.workers_rss_mib, "gauges": dict(sorted(self.gauges.items()))}


def snapshot(pid: int, metrics_port: int) -> Snapshot:
    """The server `pid`'s processes (read before /metrics, so the scrape's own socket and thread
    are not counted) and its gauges."""
    processes: dict[str, ProcessResources] = {}
    main = process_resources(pid, "main")
    if main is None:
        raise RuntimeError(f"the server process {pid} is gone")
    processes["main"] = main
    workers = 0
    for child in sorted(tree(pid)[1:]):
        kind = role(child)
        if kind == "gone" or (found := process_resources(child, kind)) is None:
            continue
        name = f"worker{workers}" if kind == "worker" else kind
        if name in processes:
            name = f"{name}_{child}"
        workers += kind == "worker"
        processes[name] = found
    return Snapshot(processes, scrape(metrics_port))


@dataclass(frozen=True)
class Tolerances:
    """How far a snapshot may be from its baseline and still count as back."""

    rss_ratio: float = 1.10  # each process's RSS at most this times its baseline RSS
    thread_slack: int = 2  # the main process's threads within this of the baseline
    fd_slack: int = 0  # each process's open fds within this of the baseline


def add_settle_flags(parser: Any, after: str) -> None:
    """The flags both long runs share: how long the server gets to settle `after` something,
    the tolerances (`Tolerances`) and where its log goes; read back with `tolerances_of(args)`."""
    parser.add_argument("--settle-s", type=float, default=60.0,
                        help=f"seconds the server gets after {after} to return to the baseline (default 60)")
    parser.add_argument("--rss-ratio", type=float, default=Tolerances.rss_ratio,
                        help=f"largest RSS / baseline RSS of each process (default {Tolerances.rss_ratio:g})")
    parser.add_argument("--thread-slack", type=int, default=Tolerances.thread_slack,
                        help=f"main-process threads allowed off the baseline (default {Tolerances.thread_slack})")
    parser.add_argument("--server-log", type=Path, default=None, help="write the server's log here")


def tolerances_of(args: Any) -> Tolerances:
    return Tolerances(args.rss_ratio, args.thread_slack)


def compare(baseline: Snapshot, now: Snapshot, tolerances: Tolerances = Tolerances()) -> dict[str, dict[str, Any]]:
    """What did not return to the baseline, by name: {name: {baseline, now, allowed}}; empty when
    everything did."""
    out: dict[str, dict[str, Any]] = {}
    pids_then = {name: p.pid for name, p in baseline.processes.items()}
    pids_now = {name: p.pid for name, p in now.processes.items()}
    if pids_then != pids_now:
        out["processes"] = {"baseline": pids_then, "now": pids_now, "allowed": "the same processes"}
    for name, then in baseline.processes.items():
        current = now.processes.get(name)
        if current is None or current.pid != then.pid:
            continue  # reported as `processes`
        threads_allowed = tolerances.thread_slack if name == "main" else 0
        checks = (("threads", abs(current.threads - then.threads) <= threads_allowed, f"±{threads_allowed}"),
                  ("fds", abs(current.fds - then.fds) <= tolerances.fd_slack, f"±{tolerances.fd_slack}"),
                  ("rss_mib", current.rss_mib <= then.rss_mib * tolerances.rss_ratio,
                   f"<= {round(then.rss_mib * tolerances.rss_ratio, 1)} (x{tolerances.rss_ratio:g})"))
        for what, ok, allowed in checks:
            if not ok:
                out[f"{name}.{what}"] = {"baseline": getattr(then, what), "now": getattr(current, what),
                                         "allowed": allowed}
    for key in sorted(set(baseline.gauges) | set(now.gauges)):
        # A labelled gauge first set during the run (a lane's queue seen busy) is back at 0.
        then_value, now_value = baseline.gauges.get(key, 0.0), now.gauges.get(key, 0.0)
        if then_value != now_value:
            out[key] = {"baseline": then_value, "now": now_value, "allowed": "exact"}
    return out


async def settle(pid: int, metrics_port: int, baseline: Snapshot, tolerances: Tolerances = Tolerances(),
                 timeout_s: float = 60.0, poll_s: float = 0.5) -> tuple[Snapshot, dict[str, dict[str, Any]], float]:
    """Poll the server until nothing differs from `baseline` or `timeout_s` passes:
    (the last snapshot, what still differs, seconds waited)."""
    started = time.monotonic()
    while True:
        now = await asyncio.to_thread(snapshot, pid, metrics_port)
        differences = compare(baseline, now, tolerances)
        waited = time.monotonic() - started
        if not differences or waited >= timeout_s:
            return now, differences, round(waited, 1)
        await asyncio.sleep(poll_s)


def busy(gauges: dict[str, float]) -> dict[str, float]:
    """The gauges that are not at rest: open or draining sessions, queued lane work, busy or
    waited-for LM slots, open ASR streams."""
    return {k: v for k, v in gauges.items() if v and (
        k.startswith(("rtmedia_sessions_", "rtmedia_lane_queue_depth", "rtmedia_asr_streams", "rtmedia_token_sessions"))
        or k in ('rtmedia_lm_slots{state="busy"}', 'rtmedia_lm_slots{state="kept"}',
                 'rtmedia_lm_slots{state="waiting"}'))}


async def quiet(metrics_port: int, timeout_s: float = 120.0, poll_s: float = 0.2) -> tuple[float, dict[str, float]]:
    """Wait until the server is at rest (see `busy`): (seconds waited, what was still busy at
    the deadline; empty when it came to rest)."""
    started = time.monotonic()
    while True:
        still = busy(await asyncio.to_thread(scrape, metrics_port))
        if not still or time.monotonic() - started >= timeout_s:
            return round(time.monotonic() - started, 1), still
        await asyncio.sleep(poll_s)
