"""Debian's haproxy in front of rtmedia replicas, as deploy/README.md configures a proxy: TLS
terminated at the proxy, HTTP/2 (h2c) to each replica, least-connections balancing, readiness
from each replica's /readyz on its metrics port, and timeouts that never cut a stream a
session keeps alive. Used by tests/e2e/test_proxy.py and tests/perf/bench_proxy.py."""

from __future__ import annotations

import csv
import io
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.serve import RTMEDIA, free_port, wait_serving

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"

CONFIG = """\
global
    stats socket {stats} mode 600 level admin
    maxconn 4096

defaults
    mode http
    # A session's stream carries audio every 20 ms; these are the silence it may keep on either
    # side before the proxy closes it (the server's own idle cap, session_max_idle_s, is 1800 s).
    timeout connect 2s
    timeout client 1860s
    timeout server 1860s
    timeout http-request 10s

frontend grpc
    bind 127.0.0.1:{port} ssl crt {pem} alpn h2
    default_backend rtmedia

backend rtmedia
    balance leastconn
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter {check_ms}ms fall 1 rise 2
{servers}
"""


@dataclass
class Replica:
    name: str
    target: str
    metrics_port: int
    process: subprocess.Popen


@contextmanager
def replicas(names: list[str], *args: str, log_dir: Path) -> Iterator[list[Replica]]:
    """`rtmedia serve ARGS --replica-name NAME` for each name, started together, once all serve."""
    started: list[Replica] = []
    try:
        for name in names:
            port, metrics = free_port(), free_port()
            with open(log_dir / f"{name}.log", "wb") as out:
                process = subprocess.Popen(
                    [RTMEDIA, "serve", "--port", str(port), "--metrics-port", str(metrics), "--replica-name", name,
                     *args], stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
            started.append(Replica(name, f"127.0.0.1:{port}", metrics, process))
        for replica in started:
            wait_serving(replica.target, replica.process, timeout=300)
        yield started
    finally:
        for replica in started:
            if replica.process.poll() is None:
                replica.process.kill()
            replica.process.wait()


class Haproxy:
    """The proxy process and its stats socket."""

    def __init__(self, directory: Path, backends: list[Replica], pem: Path, check_ms: int = 200) -> None:
        self.port = free_port()
        self.stats = directory / "haproxy.sock"
        servers = "\n".join(f"    server {r.name} {r.target} proto h2 check port {r.metrics_port} check-proto h1" for r in backends)
        self.config = directory / "haproxy.cfg"
        self.config.write_text(CONFIG.format(stats=self.stats, port=self.port, pem=pem, check_ms=check_ms,
                                             servers=servers))
        check = subprocess.run([HAPROXY, "-c", "-q", "-f", str(self.config)], capture_output=True, text=True)
        if check.returncode:
            raise RuntimeError(f"haproxy refused its configuration: {check.stdout}{check.stderr}")
        self.process = subprocess.Popen([HAPROXY, "-db", "-f", str(self.config)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)

    @property
    def target(self) -> str:
        return f"localhost:{self.port}"

    def status(self) -> dict[str, str]:
        """Each backend server's status as the proxy sees it (UP, DOWN, ...)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.stats))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
        return {row["svname"]: row["status"] for row in rows if row["pxname"] == "rtmedia"
                and row["svname"] not in ("FRONTEND", "BACKEND")}

    def wait_status(self, wanted: dict[str, str], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.process.returncode}")
            try:
                status = self.status()
                if all(status.get(name, "").startswith(want) for name, want in wanted.items()):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"haproxy's backends did not become {wanted}")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def combined_pem(cert: Path, key: Path, to: Path) -> Path:
    """haproxy's `crt`: the certificate chain and its key in one file."""
    to.write_bytes(cert.read_bytes() + key.read_bytes())
    to.chmod(0o600)
    return to
