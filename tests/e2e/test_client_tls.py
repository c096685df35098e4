"""The client commands against the real `rtmedia serve` over mutual TLS with bearer tokens:
`voices` and `loadtest` with a token, one-line errors for a missing client certificate, a
wrong or missing token, and a token over its quota."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
from rtmedia.clients.audio_file import write_audio
from rtmedia.clients.credentials import TOKEN_ENV

from tests.support.certs import Certs, make_certs
from tests.support.serve import FEW_SPEAKERS, RTMEDIA, running_server

pytestmark = pytest.mark.e2e
TOKEN = "alice-token-0123456789"
QUOTA_TOKEN = "bob-token-0123456789ab"  # one session a minute


@contextmanager
def tls_server(certs: Certs, *args: str, log: Path) -> Iterator[str]:
    """`rtmedia serve` with TLS requiring a client certificate from certs.ca, once SERVING: its target."""
    credentials = grpc.ssl_channel_credentials(certs.ca.read_bytes(), certs.client_key.read_bytes(),
                                               certs.client_cert.read_bytes())
    with running_server("--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                        "--tls-client-ca", str(certs.ca), *args, log=log, credentials=credentials,
                        asr_decoders=FEW_SPEAKERS) as (target, _):
        yield target


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def target(certs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    tokens = folder / "tokens"
    tokens.write_text(f"{TOKEN} alice\n{QUOTA_TOKEN} bob sessions_per_minute=1\n")
    with tls_server(certs, "--no-llm", "--responder", "echo", "--metrics-port", "0", "--auth-tokens", str(tokens),
                    log=folder / "serve.log") as target:
        yield target


def rtmedia(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return subprocess.run([RTMEDIA, *args], capture_output=True, text=True, timeout=120, env=env)


def mtls(certs: Certs, target: str) -> list[str]:
    return ["--target", target, "--ca", str(certs.ca), "--cert", str(certs.client_cert), "--key",
            str(certs.client_key)]


def one_line_error(result: subprocess.CompletedProcess, command: str, *words: str) -> str:
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"rtmedia {command}: "), lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_voices_over_mutual_tls_with_a_token(target, certs):
    result = rtmedia("voices", *mtls(certs, target), "--token", TOKEN, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["voices"]


def test_loadtest_over_mutual_tls_with_a_token(target, certs):
    result = rtmedia("loadtest", *mtls(certs, target), "--token", TOKEN, "--profile", "listen", "--sessions", "2",
                     "--duration", "3", "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["sessions_started"] == report["sessions_completed"] == 2
    assert report["sessions_rejected"] == 0 and report["errors"] == 0, report["errors_by_code"]


def test_refusals_are_one_line(target, certs):
    without_cert = ["--target", target, "--ca", str(certs.ca), "--token", TOKEN, "--timeout", "20"]
    one_line_error(rtmedia("voices", *without_cert), "voices", "UNAVAILABLE", "--cert and --key")
    one_line_error(rtmedia("loadtest", *without_cert[:-2], "--connect-timeout", "10", "--profile", "listen",
                           "--sessions", "1", "--duration", "3"), "loadtest", "cannot reach", "--cert and --key")
    one_line_error(rtmedia("voices", *mtls(certs, target), "--token", "wrong-token-0123456789"), "voices",
                   "the server refused the token (UNAUTHENTICATED)")
    one_line_error(rtmedia("voices", *mtls(certs, target)), "voices", "the server wants a token (UNAUTHENTICATED)",
                   f"--token or set {TOKEN_ENV}")
    one_line_error(rtmedia("loadtest", *mtls(certs, target), "--token", "wrong-token-0123456789", "--profile", "listen",
                           "--sessions", "1", "--duration", "3", "--quiet"), "loadtest",
                   "the server refused the token (UNAUTHENTICATED)")
    # and the plaintext door is shut to a non-loopback address before anything is sent
    one_line_error(rtmedia("voices", "--target", "192.0.2.1:50051", "--token", TOKEN), "voices",
                   "refusing to send a token in plaintext to 192.0.2.1; use --tls")


def test_a_token_over_its_quota(target, certs, tmp_path):
    """bob may open one session a minute: the load tester counts the second as rejected, and
    `talk` after it gets a one-line refusal with the seconds to wait."""
    result = rtmedia("loadtest", *mtls(certs, target), "--token", QUOTA_TOKEN, "--profile", "listen", "--sessions",
                     "2", "--duration", "3", "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["sessions_started"] == 2 and report["sessions_rejected"] == 1, report
    assert report["errors"] == 0, report["errors_by_code"]
    write_audio(tmp_path / "hello.wav", np.zeros(8000, np.int16).tobytes(), 16000)
    one_line_error(rtmedia("talk", str(tmp_path / "hello.wav"), *mtls(certs, target), "--token", QUOTA_TOKEN), "talk",
                   "over the token's quota (QUOTA)", "retry in")
