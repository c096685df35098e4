"""`rtmedia doctor` as a process: every line is reported, nothing fails on this machine, CUDA graphs are
checked on a GPU and reported as skipped (never as passed) without one, kernels run against their
references with their max error."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.support.serve import RTMEDIA

pytestmark = pytest.mark.e2e


def test_doctor_json() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([RTMEDIA, "doctor", "--json", "--synthetic-lm", "tiny"], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] and list(checks) == ["device", "engine lm", "engine video", "engine vad", "engine asr",
                                             "cuda graphs", "kernel rms_norm_silu", "kernel causal_conv_assemble"]
    asr = "(torch, cuda, float16) loads and decodes" if torch.cuda.is_available() else "(ct2, cpu, int8) loads and decodes"
    assert f"Whisper whisper-tiny {asr}" in checks["engine asr"]["detail"]
    assert "synthetic tiny (random weights)" in checks["engine lm"]["detail"]
    if torch.cuda.is_available():
        assert checks["cuda graphs"]["status"] == "pass" and checks["cuda graphs"]["max_error"] == 0.0
    else:
        assert checks["cuda graphs"]["status"] == "skip" and "no CUDA" in checks["cuda graphs"]["detail"]
        assert "interpreter" in checks["kernel rms_norm_silu"]["detail"]
    assert checks["kernel rms_norm_silu"]["status"] == "pass" and checks["kernel rms_norm_silu"]["max_error"] <= 1e-5
    assert checks["kernel causal_conv_assemble"]["max_error"] == 0.0


def test_doctor_reports_a_failure_with_exit_status() -> None:
    proc = subprocess.run([RTMEDIA, "doctor", "--no-engines", "--synthetic-lm", "tiny"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TRITON_INTERPRET": "0"})
    if torch.cuda.is_available():
        pytest.skip("kernels compile on CUDA; TRITON_INTERPRET=0 is no failure there")
    assert proc.returncode == 1
    assert "FAIL  kernel rms_norm_silu" in proc.stdout and "kernel did not run" in proc.stdout
    assert "check(s) failed" in proc.stderr
