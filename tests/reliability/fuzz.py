"""The long fuzz run: every door of tests/reliability/doors/, `--cases` Hypothesis cases each,
against a real `rtmedia serve` process (echo responder, the Riva API, `--auth-tokens`, and the
bridge beside it with `--web`), while a well-behaved session (tests/reliability/talker.py, a
process of its own) keeps talking with the right token.

    .venv/bin/python tests/reliability/fuzz.py [--door NAME ...] [--cases 10000] [--seed 0] [--jobs 1]

`--jobs N` runs N cases of a door at once (each job its own tokens and seed, `--cases` split
between them), for the doors whose cases mostly wait (converse): a job's sessions are counted by
its tokens (`rtmedia_token_sessions_active`), so each case is still judged alone. The doors that
make bridge peers (`Door.peers`) run one job at a time: the bridge's peers are counted for all.
An error line the server logs is judged against the case that next looks, whichever job's it is.

Prints one JSON object, and exits 1 when a case broke a rule or the server died: per door the cases run, crashes (the server exited or stopped answering
health), leaked sessions and bridge peers, the statuses by code and ErrorInfo reason (HTTP
statuses by code and reason for the web doors), how many were UNKNOWN or INTERNAL, the error
events by code, the cases that broke a rule (a few, with the problems and the case), cases per
second, and the well-behaved session's response latency p50/p95 before the fuzzing (measured
once, at the start) and while that door was fuzzed, with their ratios. Cases are not shrunk:
a failing case is reported as drawn; the quick tests (test_fuzz.py) shrink theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402

from tests.reliability.doors import (  # noqa: E402
    DOORS,
    Door,
    Target,
    Verdict,
    case_repr,
    doors_for,
    offer_sdp,
    probe_latent_channels,
    run_case,
)
from tests.reliability.talker import percentile  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402
from tests.support.webrtc import wait_http  # noqa: E402

GOOD = "fuzz-good-token-0123456789"
LIMITED = "fuzz-limited-token-0123456789"
EXAMPLES_KEPT = 10  # failing cases kept per door in the report


def job_token(j: int, kind: str = "job") -> str:
    return f"fuzz-{kind}-{j}-token-0123456789"


def tokens_file(jobs: int) -> str:
    """The server's tokens: the talker's and the single job's, and with `jobs` > 1 each job's two."""
    lines = [f"{GOOD} good", f"{LIMITED} limited max_sessions=2"]
    if jobs > 1:
        lines += [f"{job_token(j)} job-{j}\n{job_token(j, 'limited')} limited-{j} max_sessions=2" for j in range(jobs)]
    return "\n".join(lines) + "\n"


class TalkerProcess:
    """tests/reliability/talker.py as a child process; its turns as they are reported."""

    def __init__(self, target: str, token: str) -> None:
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("talker.py")),
                                         "--target", target, "--token", token],
                                        stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.turns: list[dict[str, Any]] = []
        self.ended: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            record = json.loads(line)
            with self._lock:
                if "status" in record:
                    self.turns.append(record)
                elif "ended" in record:
                    self.ended = record

    def wait_turns(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.turns) < n:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"the well-behaved session completed {len(self.turns)} of {n} turns")
            time.sleep(0.2)

    def window(self, start: float, end: float) -> list[dict[str, Any]]:
        with self._lock:
            return [t for t in self.turns if start <= t["t"] <= end]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)


def latency(turns: list[dict[str, Any]]) -> dict[str, Any]:
    values = [t["latency_s"] for t in turns if t["status"] == "completed" and t["latency_s"] is not None]
    return {"turns": len(turns), "failed_turns": sum(t["status"] != "completed" for t in turns),
            "p50_s": _round(percentile(values, 0.5)), "p95_s": _round(percentile(values, 0.95))}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _ratio(during: float | None, before: float | None) -> float | None:
    return None if during is None or not before else round(during / before, 3)


@dataclass
class DoorStats:
    name: str
    cases: int = 0
    crashes: int = 0
    leaked_sessions: int = 0
    leaked_peers: int = 0
    failing_cases: int = 0
    client_errors: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    error_events: Counter[str] = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)
    stopped: bool = False  # the server is gone: the rest of the door's cases are not sent
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # jobs add from their threads

    def add(self, verdict: Verdict, case: Any) -> None:
        with self.lock:
            self._add(verdict, case)

    def _add(self, verdict: Verdict, case: Any) -> None:
        self.cases += 1
        self.statuses.update(verdict.outcome.statuses)
        self.error_events.update(verdict.outcome.error_events)
        self.leaked_sessions += verdict.leaked_sessions
        self.leaked_peers += verdict.leaked_peers
        if verdict.crashed:
            self.crashes += 1
        if verdict.problems:
            self.failing_cases += 1
            if len(self.examples) < EXAMPLES_KEPT:
                self.examples.append({"problems": verdict.problems[:5], "case": case_repr(case)})

    def failed_client(self, exc: BaseException, case: Any) -> None:
        with self.lock:
            self.client_errors += 1
            if len(self.examples) < EXAMPLES_KEPT:
                self.examples.append({"client_error": f"{type(exc).__name__}: {exc}"[:500],
                                      "case": case_repr(case)})


def drive(door: Door, cases: int, seed: int, loop: asyncio.AbstractEventLoop, target: Target, stats: DoorStats,
          server: subprocess.Popen) -> None:
    """Draw up to `cases` cases of `door` with Hypothesis (in this thread) and run each on `loop`."""

    @settings(max_examples=cases, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])
    @hypothesis_seed(seed)
    @given(case=door.cases)
    def one(case: Any) -> None:
        if stats.stopped:
            return
        try:
            verdict = asyncio.run_coroutine_threadsafe(run_case(target, door, case), loop).result()
        except Exception as exc:  # a failure of the fuzzing client itself: counted, and the run goes on
            stats.failed_client(exc, case)
            return
        stats.add(verdict, case)
        if verdict.crashed and server.poll() is not None:
            stats.stopped = True

    one()


class ServerView:
    """What the run sees of the server process: its metrics, health, log and web port."""

    def __init__(self, channel: grpc.aio.Channel, http: aiohttp.ClientSession, process: subprocess.Popen,
                 metrics_url: str, web_url: str, log: Path) -> None:
        self.channel, self.http, self.process = channel, http, process
        self.metrics_url, self.web_url, self.log = metrics_url, web_url, log
        self._log_offset = log.stat().st_size if log.exists() else 0
        self._health = health_pb2_grpc.HealthStub(channel)

    async def sessions(self) -> int:
        async with self.http.get(self.metrics_url) as res:
            text = await res.text()
        found = re.search(r"^rtmedia_sessions_active (\S+)$", text, re.M)
        return int(float(found.group(1))) if found else 0

    def sessions_of(self, *names: str) -> Callable[[], Awaitable[int]]:
        """Sessions open now under the tokens called `names` (a job's)."""
        async def count() -> int:
            async with self.http.get(self.metrics_url) as res:
                text = await res.text()
            return sum(int(float(found.group(1))) for name in names
                       if (found := re.search(rf'^rtmedia_token_sessions_active{{token="{name}"}} (\S+)$', text, re.M)))
        return count

    async def alive(self) -> bool:
        if self.process.poll() is not None:
            return False
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def peers(self) -> int:
        async with self.http.get(f"{self.web_url}/healthz") as res:
            body = await res.json()
        return int(body["peers"]) + int(body["opening"])

    def errors_logged(self) -> list[str]:
        with open(self.log, "rb") as f:
            f.seek(self._log_offset)
            data = f.read()
        self._log_offset += len(data)
        lines = data.decode(errors="replace").splitlines()
        return [line for line in lines if '"level": "error"' in line or '"level": "critical"' in line
                or line.startswith("Traceback")]


async def fuzz(args: argparse.Namespace, address: str, process: subprocess.Popen, metrics_url: str, web_url: str,
               log: Path, talker: TalkerProcess | None, before: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel, aiohttp.ClientSession() as http:
        view = ServerView(channel, http, process, metrics_url, web_url, log)
        metadata = (("authorization", f"Bearer {GOOD}"),)
        target = Target(channel=channel, token=GOOD, limited_token=LIMITED, sessions=view.sessions,
                        alive=view.alive, errors_logged=view.errors_logged,
                        latent_channels=await probe_latent_channels(channel, metadata),
                        max_receive_bytes=args.max_receive_bytes, features=frozenset({"riva", "web", "auth", "openai"}),
                        web_url=web_url, http=http, web_peers=view.peers, offer_sdp=await offer_sdp())
        target.baseline_sessions = await view.sessions()
        # Job j's own tokens (tokens_file), its sessions counted by their names; no bridge peers.
        jobs = [target] if args.jobs == 1 else [
            dataclasses.replace(target, token=job_token(j), limited_token=job_token(j, "limited"),
                                sessions=view.sessions_of(f"job-{j}", f"limited-{j}"), web_peers=None,
                                baseline_sessions=0)
            for j in range(args.jobs)]
        view.errors_logged()  # what start-up logged is not the fuzzing's
        report: dict[str, Any] = {}
        for door in doors_for(target.features, args.door):
            if process.poll() is not None:
                report[door.name] = {"skipped": "the server is not running"}
                continue
            stats = DoorStats(door.name)
            start, started = time.monotonic(), time.perf_counter()
            targets = [target] if door.peers else jobs
            shares = [args.cases // len(targets) + (j < args.cases % len(targets)) for j in range(len(targets))]
            await asyncio.gather(*(asyncio.to_thread(drive, door, share, args.seed + j, loop, job, stats, process)
                                   for j, (job, share) in enumerate(zip(targets, shares, strict=True)) if share))
            seconds = time.perf_counter() - started
            during = latency(talker.window(start, time.monotonic())) if talker else {}
            report[door.name] = {
                "cases": stats.cases, "seconds": round(seconds, 1),
                "cases_per_s": round(stats.cases / seconds, 2) if seconds else None,
                "crashes": stats.crashes, "leaked_sessions": stats.leaked_sessions,
                "leaked_peers": stats.leaked_peers,
                "unknown_internal": sum(n for s, n in stats.statuses.items()
                                        if s.split("/")[0] in ("UNKNOWN", "INTERNAL")),
                "failing_cases": stats.failing_cases, "client_errors": stats.client_errors,
                "statuses": dict(stats.statuses.most_common()), "error_events": dict(stats.error_events.most_common()),
                "talker": {"before": before, "during": during,
                           "p50_ratio": _ratio(during.get("p50_s"), before.get("p50_s")),
                           "p95_ratio": _ratio(during.get("p95_s"), before.get("p95_s"))},
                "examples": stats.examples,
            }
        return report


def main() -> int:
    parser = argparse.ArgumentParser(description="Fuzz every door of a real `rtmedia serve` (see the module "
                                                 "docstring); prints one JSON object.")
    parser.add_argument("--door", action="append", default=None, choices=list(DOORS), metavar="NAME",
                        help=f"fuzz only this door (repeatable; default all: {', '.join(DOORS)})")
    parser.add_argument("--cases", type=int, default=10000, help="cases per door (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0: the same cases every run)")
    parser.add_argument("--jobs", type=int, default=1, help="cases of a door run at once (default 1; not the "
                                                            "bridge doors'; see the module docstring)")
    parser.add_argument("--before-turns", type=int, default=5,
                        help="turns of the well-behaved session measured before the fuzzing (default 5)")
    parser.add_argument("--no-talker", action="store_true", help="no well-behaved session (no latency figures)")
    parser.add_argument("--log", default=None, help="keep the server's log in this file")
    args = parser.parse_args()
    if args.cases < 1 or args.jobs < 1:
        parser.error("--cases and --jobs must be at least 1")
    from rtmedia.server.config import ServerConfig

    from tests.perf.bench_speech import machine

    args.max_receive_bytes = ServerConfig().max_receive_bytes
    with tempfile.TemporaryDirectory(prefix="rtmedia-fuzz-") as tmp:
        tokens = Path(tmp) / "tokens"
        tokens.write_text(tokens_file(args.jobs))
        log = Path(args.log) if args.log else Path(tmp) / "serve.log"
        web_port, metrics_port = free_port(), free_port()
        serve = ("--metrics-port", str(metrics_port), "--no-llm", "--responder", "echo", "--grace", "2",
                 "--max-sessions", "64", "--auth-tokens", str(tokens), "--web", "--web-port", str(web_port))
        started = time.perf_counter()
        with running_server(*serve, log=log) as (address, process):
            web_url = f"http://127.0.0.1:{web_port}"
            wait_http(f"{web_url}/healthz", process)
            talker = None if args.no_talker else TalkerProcess(address, GOOD)
            try:
                before: dict[str, Any] = {}
                if talker is not None:
                    start = time.monotonic()
                    talker.wait_turns(args.before_turns, timeout=60 + 20 * args.before_turns)
                    before = latency(talker.window(start, time.monotonic()))
                doors = asyncio.run(fuzz(args, address, process, f"http://127.0.0.1:{metrics_port}/metrics",
                                         web_url, log, talker, before))
            finally:
                if talker is not None:
                    talker.stop()
            exit_code = process.poll()  # None: it was still serving when the run ended
        tail = log.read_bytes()[-2000:].decode(errors="replace") if exit_code is not None else ""
    totals = {key: sum(d.get(key, 0) for d in doors.values())
              for key in ("cases", "crashes", "leaked_sessions", "leaked_peers", "unknown_internal", "failing_cases",
                          "client_errors")}
    print(json.dumps({
        "benchmark": "fuzz", "machine": machine(), "cases_per_door": args.cases, "seed": args.seed, "jobs": args.jobs,
        "server": "rtmedia serve " + " ".join("FILE" if a == str(tokens) else a for a in serve),
        "seconds": round(time.perf_counter() - started, 1), "totals": totals,
        "talker": {"before": before, "ended": talker.ended if talker else None},
        "server_exit_code": exit_code, **({"server_log_tail": tail} if tail else {}),
        "doors": doors,
    }, indent=1))
    broken = exit_code is not None or any(totals[key] for key in ("crashes", "leaked_sessions", "leaked_peers",
                                                                   "unknown_internal", "failing_cases"))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
