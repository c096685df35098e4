"""Running the real `rtmedia serve` process for tests and benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

RTMEDIA = str(Path(sys.executable).with_name("rtmedia"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(target: str, process: subprocess.Popen, timeout: float = 120) -> None:
    """Block until the server's health says SERVING; raise if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"rtmedia serve exited with {process.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError("rtmedia serve did not become SERVING")
