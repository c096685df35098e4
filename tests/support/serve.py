"""Running the real `rtmedia serve` process for tests and benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

RTMEDIA = str(Path(sys.executable).with_name("rtmedia"))
# The fast ASR decoders a test's server warms per worker: its tests speak a few sessions at once.
FEW_SPEAKERS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A sync channel to `target`: TLS with `credentials`, else plaintext."""
    return grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)


def wait_serving(target: str, process: subprocess.Popen, timeout: float = 120,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Block until the server's health says SERVING; raise if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    with channel(target, credentials) as channel_:
        stub = health_pb2_grpc.HealthStub(channel_)
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


@contextmanager
def running_server(*args: str, log: Path | None = None, credentials: grpc.ChannelCredentials | None = None,
                   env: dict[str, str] | None = None,
                   asr_decoders: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`rtmedia serve ARGS` on a free port, once SERVING: (target, process); terminated at exit.
    Its output goes to `log` (default: discarded); `credentials`: how to reach a TLS port;
    `env`: variables added to this process's environment; `asr_decoders`: the fast decoders each
    ASR worker warms (default: the server's own, sized for many speakers; a test with a few
    speakers passes `FEW_SPEAKERS` and starts in a third of the time)."""
    port = free_port()
    if asr_decoders is not None:
        args = ("--asr-decoders", str(asr_decoders), *args)
    with open(log, "wb") if log else open(os.devnull, "wb") as out:
        process = subprocess.Popen([RTMEDIA, "serve", "--port", str(port), *args], stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, process, credentials=credentials)
        yield target, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
