"""Triton kernels against their torch reference twins, under the Triton interpreter on the CPU
(on a GPU machine they run as compiled kernels), plus dispatch fallbacks and the Wan fast path."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
pytest.importorskip("triton")

from rtmedia.kernels import wan
from rtmedia.kernels.causal_conv import assemble, assemble_reference
from rtmedia.kernels.dispatch import Dispatcher
from rtmedia.kernels.rmsnorm import rms_norm, rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def launched(dispatcher: Dispatcher, fn, *args):
    before = dispatcher.launches
    out = fn(*args)
    assert dispatcher.launches == before + 1, dispatcher.stats()
    return out


@pytest.mark.parametrize("shape", [(1, 8, 1, 3, 5), (2, 12, 2, 4, 4), (1, 5, 7, 3)])
@pytest.mark.parametrize("silu", [False, True])
def test_rms_norm_matches_reference_fp32(shape, silu):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(DEVICE)
    c = shape[1]
    gamma = torch.randn((c,) + (1,) * (len(shape) - 2), generator=g).to(DEVICE)
    bias = torch.randn_like(gamma) if shape[0] == 2 else 0.0
    scale = c**0.5
    out = launched(rms_norm, rms_norm, x, gamma, bias, scale, silu)
    ref = rms_norm_reference(x, gamma, bias, scale, silu)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


def test_rms_norm_time_major_input():
    """The decoder's temporal upsampling leaves x as a [B, C, T, H, W] view of [B, T, C, H, W]."""
    x = torch.randn(1, 3, 6, 2, 4).to(DEVICE).permute(0, 2, 1, 3, 4)
    gamma = torch.randn(6, 1, 1, 1).to(DEVICE)
    out = launched(rms_norm, rms_norm, x, gamma, 0.0, 2.0, True)
    assert torch.allclose(out, rms_norm_reference(x, gamma, 0.0, 2.0, True), atol=1e-5, rtol=1e-5)


def test_rms_norm_zero_input_is_zero():
    x = torch.zeros(1, 4, 1, 2, 2, device=DEVICE)
    gamma = torch.ones(4, 1, 1, 1, device=DEVICE)
    assert torch.equal(launched(rms_norm, rms_norm, x, gamma, 0.0, 2.0, True), torch.zeros_like(x))


@pytest.mark.parametrize("cache_frames", [None, 1, 2])
def test_assemble_matches_reference_bit_exact(cache_frames):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 2, 4, 5, generator=g).to(DEVICE)
    cache = None if cache_frames is None else torch.randn(1, 3, cache_frames, 4, 5, generator=g).to(DEVICE)
    padding = (1, 1, 1, 1, 2, 0)
    out = launched(assemble, assemble, x, cache, padding)
    assert torch.equal(out, assemble_reference(x, cache, padding))


def test_assemble_spatial_only_and_uneven_padding():
    x = torch.randn(2, 2, 1, 3, 3).to(DEVICE)
    for padding in [(0, 0, 0, 0, 2, 0), (2, 1, 0, 1, 1, 0)]:
        out = launched(assemble, assemble, x, None, padding)
        assert torch.equal(out, assemble_reference(x, None, padding))


def test_assemble_time_major_views():
    base = torch.randn(1, 4, 3, 2, 5).to(DEVICE)  # [B, T, C, H, W]
    x = base.permute(0, 2, 1, 3, 4)
    cache = x[:, :, -2:].clone()  # clone keeps the strides, as in the decoder
    out = launched(assemble, assemble, x, cache, (1, 1, 1, 1, 2, 0))
    assert out.is_contiguous() and torch.equal(out, assemble_reference(x, cache, (1, 1, 1, 1, 2, 0)))


def test_fallbacks_are_the_reference_and_say_why():
    x = torch.randn(1, 4, 2, 3, 3, device=DEVICE)
    gamma = torch.randn(4, 1, 1, 1, device=DEVICE)
    rms_norm.reset()
    cases = [
        (x.transpose(3, 4), "not dense"),
        (x.double(), "dtype"),
        (x[:, :, 0, 0], "needs [B, C, H, W]"),
    ]
    for arg, why in cases:
        out = rms_norm(arg, gamma, 0.0, 2.0, True)
        assert torch.equal(out, rms_norm_reference(arg, gamma, 0.0, 2.0, True))
        assert any(why in reason for reason in rms_norm.fallbacks), rms_norm.fallbacks
    assert rms_norm.launches == 0
    cache = torch.randn(1, 4, 3, 3, 3, device=DEVICE)  # 3 cached frames > causal padding 2
    out = assemble(x, cache, (1, 1, 1, 1, 2, 0))
    ref = assemble_reference(x, cache, (1, 1, 1, 1, 2, 0))
    assert out.shape == ref.shape and torch.equal(out, ref)


def test_cpu_without_interpreter_falls_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(1, 4, 1, 2, 2)
    gamma = torch.ones(4, 1, 1, 1)
    d = Dispatcher("t", lambda *a: pytest.fail("kernel ran"), rms_norm_reference, rms_norm.contract)
    assert torch.equal(d(x, gamma, 0.0, 2.0, False), rms_norm_reference(x, gamma, 0.0, 2.0, False))
    assert list(d.fallbacks) == ["cpu tensors need CUDA or TRITON_INTERPRET=1"]


def test_failed_launch_is_remembered_per_key(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []

    def broken(*args):
        calls.append(args[0].shape)
        raise RuntimeError("out of resources")

    d = Dispatcher("t", broken, rms_norm_reference, rms_norm.contract)
    a, b = torch.randn(1, 4, 1, 2, 2), torch.randn(1, 4, 1, 3, 3)
    gamma = torch.ones(4, 1, 1, 1)
    for x in (a, a, b, a):
        assert torch.equal(d(x, gamma, 0.0, 2.0, True), rms_norm_reference(x, gamma, 0.0, 2.0, True))
    assert calls == [a.shape, b.shape]  # each key launched once
    assert d.fallbacks["launch failed"] == 2 and sum(d.fallbacks.values()) == 4
    assert len(d.failures) == 2


def test_fused_decoder_matches_reference_decoder():
    from rtmedia.engines.video.decoder import VideoEngine
    from rtmedia.engines.video.plan import causal_plan

    engine = VideoEngine()
    engine.load()
    latent = torch.randn(16, 3, 2, 2, generator=torch.Generator().manual_seed(3))

    def decode() -> list:
        stream = engine.open_stream(latent, causal_plan(3), 0, 0)
        try:
            return [engine.decode_step(stream) for _ in stream.plan.steps]
        finally:
            engine.close_stream(stream)

    reference = decode()
    changed = wan.install(engine.vae, "fused")
    assert changed > 0 and wan.level(engine.vae) == "fused"
    rms_norm.reset()
    assemble.reset()
    try:
        fused = decode()
    finally:
        wan.install(engine.vae, "off")
    assert rms_norm.launches > 0 and assemble.launches > 0, (rms_norm.stats(), assemble.stats())
    assert not rms_norm.fallbacks and not assemble.fallbacks
    for a, b in zip(reference, fused, strict=True):
        assert a.shape == b.shape
        assert abs(a - b).max() < 1e-5
    assert wan.level(engine.vae) == "off"
    assert all(not isinstance(m, wan.FusedRMSNorm) for m in engine.vae.decoder.modules())
    assert all((a == b).all() for a, b in zip(reference, decode(), strict=True))  # "off" is diffusers again
