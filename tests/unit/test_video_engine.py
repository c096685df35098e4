"""The video engine on the embedded random-weight Wan VAE: stepped decode equals
diffusers' own `vae.decode`, bit for bit, and streams keep their own caches."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from rtmedia.engines.base import EngineError
from rtmedia.engines.video.decoder import VideoEngine, VideoOneShot, VideoStep
from rtmedia.engines.video.plan import Assembler, causal_plan, make_plan


@pytest.fixture(scope="module")
def engine():
    e = VideoEngine()
    e.load()
    e.warmup()
    yield e
    e.close()


def latent(t, h, w, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((16, t, h, w)).astype(np.float32))


def chunked(engine, z, plan, height=0, width=0):
    stream = engine.open_stream(z, plan, height, width)
    assembler = Assembler(plan)
    out = [c for _ in plan.steps for c in assembler.push(engine.step([VideoStep(stream)])[0])]
    out.append(assembler.finish())
    engine.close_stream(stream)
    return np.concatenate([c.frames for c in out])


def one_shot(engine, z, plan, height=0, width=0):
    stream = engine.open_stream(z, plan.one_shot(), height, width)
    assembler = Assembler(plan.one_shot())
    for frames in engine.step([VideoOneShot(stream)])[0]:
        assembler.push(frames)
    engine.close_stream(stream)
    return assembler.finish().frames


@pytest.mark.parametrize(("kind", "t", "h", "w", "crop"), [
    ("causal", 1, 2, 2, (0, 0)), ("causal", 4, 3, 2, (0, 0)), ("causal", 6, 4, 4, (20, 30)),
    ("overlapped", 3, 2, 2, (0, 0)), ("overlapped", 9, 2, 3, (16, 8)),
])
def test_stepped_decode_equals_vae_decode(engine, kind, t, h, w, crop):
    z = latent(t, h, w, seed=t)
    plan = make_plan(kind, t)
    got = chunked(engine, z, plan, *crop)
    ref = one_shot(engine, z, plan, *crop)
    assert got.shape == (plan.total_frames, crop[0] or 8 * h, crop[1] or 8 * w, 3)
    assert np.array_equal(got, ref)
    assert got.std() > 1, "the random VAE still draws something"
    if kind == "causal":  # against diffusers directly, not through the engine's one-shot path
        with torch.inference_mode():
            direct = engine.vae.decode(z.unsqueeze(0)).sample[0]
        direct = ((direct + 1) / 2).permute(1, 2, 3, 0).numpy()[:, :crop[0] or None, :crop[1] or None]
        assert np.array_equal(got, np.rint(np.clip(direct, 0, 1) * 255).astype(np.uint8))


def test_interleaved_streams_keep_their_own_caches(engine):
    za, zb = latent(4, 2, 2, seed=1), latent(5, 2, 2, seed=2)
    pa, pb = causal_plan(4), causal_plan(5)
    a, b = engine.open_stream(za, pa, 0, 0), engine.open_stream(zb, pb, 0, 0)
    fa, fb = Assembler(pa), Assembler(pb)
    out_a, out_b = [], []
    for n in range(5):
        items = ([VideoStep(a)] if n < 4 else []) + [VideoStep(b)]
        results = engine.step(items)
        if n < 4:
            out_a += fa.push(results[0])
        out_b += fb.push(results[-1])
    assert engine.cached_streams == 0, "a finished segment frees its cache"
    out_a.append(fa.finish())
    out_b.append(fb.finish())
    engine.close_stream(a)
    engine.close_stream(b)
    assert np.array_equal(np.concatenate([c.frames for c in out_a]), chunked(engine, za, pa))
    assert np.array_equal(np.concatenate([c.frames for c in out_b]), chunked(engine, zb, pb))


def test_closing_frees_the_cache_and_later_steps_fail(engine):
    plan = causal_plan(3)
    stream = engine.open_stream(latent(3, 2, 2), plan, 0, 0)
    engine.step([VideoStep(stream)])
    assert engine.cached_streams == 1
    engine.close_stream(stream)
    assert engine.cached_streams == 0 and stream.id not in engine.streams
    assert stream.cache is None and stream.segment is None
    [result] = engine.step([VideoStep(stream)])
    assert isinstance(result, EngineError) and "closed" in str(result)


def test_closing_during_a_step_does_not_wait_and_the_step_frees_the_cache(engine, monkeypatch):
    """The service closes streams on the event loop, so close_stream must not wait for a step."""
    stream = engine.open_stream(latent(3, 2, 2), causal_plan(3), 0, 0)
    engine.step([VideoStep(stream)])
    inside, release = threading.Event(), threading.Event()
    real = engine._frames

    def held(*args, **kwargs):  # the step is running and holds the stream's lock
        inside.set()
        assert release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_frames", held)
    step = threading.Thread(target=engine.step, args=([VideoStep(stream)],))
    step.start()
    assert inside.wait(10)
    closer = threading.Thread(target=engine.close_stream, args=(stream,))
    closer.start()
    closer.join(2)
    closed_while_running = not closer.is_alive()
    release.set()
    step.join(10)
    closer.join(10)
    assert closed_while_running, "close_stream waited for the running step"
    assert stream.id not in engine.streams
    assert stream.cache is None and stream.segment is None, "the running step freed the cache when it ended"


def test_normalized_latents_use_the_config_statistics(engine):
    z = latent(2, 2, 2)
    mean = torch.tensor(engine.info.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(engine.info.latents_std).view(-1, 1, 1, 1)
    plan = causal_plan(2)
    stream = engine.open_stream((z - mean) / std, plan, 0, 0, normalized=True)
    assert torch.allclose(stream.latent[0], z, atol=1e-5)
    engine.close_stream(stream)
