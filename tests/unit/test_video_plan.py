"""Frame plans and the chunk assembler (docs/protocol.md#chunk-contract-3.3), on synthetic step frames."""

from __future__ import annotations

import numpy as np
import pytest
from rtmedia.engines.video.plan import (
    OVERLAP,
    Assembler,
    LatentTooShort,
    PlanError,
    blend,
    causal_plan,
    check_chunks,
    make_plan,
    overlapped_plan,
    to_uint8,
)


@pytest.mark.parametrize(("latent", "frames", "windows"), [(37, 124, 7), (62, 209, 12), (72, 243, 14),
                                                           (107, 362, 21)])
def test_overlapped_plan_reproduces_the_spec_table(latent, frames, windows):
    plan = overlapped_plan(latent)
    assert plan.total_frames == frames
    assert [c.frame_count for c in plan.chunks] == [17] * windows + [5]
    assert len(plan.segments) == windows
    assert all(stop - start == 7 for start, stop in plan.segments)
    assert [start for start, _ in plan.segments] == [5 * k for k in range(windows)]
    assert plan.padded_frames == plan.segments[-1][1]
    assert 0 <= plan.padded_frames - latent <= 4


@pytest.mark.parametrize("latent", range(3, 41))
def test_overlapped_plan_formula(latent):
    pseudo = latent + 3
    pad = (5 - pseudo % 5) % 5
    n = (pseudo + pad) // 5 - 1
    plan = overlapped_plan(latent)
    assert plan.total_frames == 17 * n + 5 and plan.total_chunks == n + 1
    assert len(plan.steps) == 7 * n


@pytest.mark.parametrize("latent", [-1, 0, 1, 2])
def test_overlapped_plan_rejects_short_latents(latent):
    with pytest.raises(LatentTooShort, match="at least 3"):
        overlapped_plan(latent)


@pytest.mark.parametrize("latent", range(1, 41))
def test_causal_plan(latent):
    plan = causal_plan(latent)
    assert plan.total_frames == 1 + 4 * (latent - 1)
    assert [c.frame_count for c in plan.chunks] == [1] + [4] * (latent - 1)
    assert [s.frames for s in plan.steps] == [1] + [4] * (latent - 1)
    assert plan.segments == [(0, latent)]
    check_chunks([(c.index, plan.total_chunks, c.frame_start, c.frame_count, c.index == latent - 1)
                  for c in plan.chunks], 1 + 4 * (latent - 1))
    for per in (2, 3):
        grouped = causal_plan(latent, per)
        assert grouped.total_chunks == -(-latent // per)
        assert grouped.total_frames == plan.total_frames
        assert grouped.chunks[0].frame_count == 1 + 4 * (min(per, latent) - 1)


def test_make_plan_rejects_unknown_plans_and_options():
    with pytest.raises(PlanError, match="unknown frame plan 'tiled'"):
        make_plan("tiled", 5)
    with pytest.raises(PlanError, match="causal plan only"):
        make_plan("overlapped", 8, 2)
    with pytest.raises(PlanError, match="at least 1"):
        make_plan("causal", 0)


def steps_of(plan, h=2, w=3):
    """Synthetic float step frames whose values encode (segment, frame within segment)."""
    out = []
    index = {}
    for step in plan.steps:
        seg = plan.segments.index((step.start, step.stop))
        first = index.get(seg, 0)
        values = [(seg * 100 + first + i) / 1000 for i in range(step.frames)]
        index[seg] = first + step.frames
        out.append(np.broadcast_to(np.array(values, np.float32).reshape(-1, 1, 1, 1), (step.frames, h, w, 3)).copy())
    return out


def run(plan, frames):
    assembler = Assembler(plan)
    chunks = []
    for f in frames:
        chunks += assembler.push(f)
        assert not any(c.is_final for c in chunks), "the final chunk is held until finish()"
    chunks.append(assembler.finish())
    return chunks


@pytest.mark.parametrize(("kind", "latent", "per"), [("causal", 1, 1), ("causal", 7, 1), ("causal", 7, 3),
                                                     ("overlapped", 3, 1), ("overlapped", 13, 1)])
def test_assembler_keeps_the_chunk_contract(kind, latent, per):
    plan = make_plan(kind, latent, per)
    chunks = run(plan, steps_of(plan))
    check_chunks([(c.chunk.index, c.total_chunks, c.chunk.frame_start, len(c.frames), c.is_final)
                  for c in chunks], plan.total_frames)
    assert all(c.frames.dtype == np.uint8 and c.frames.flags.owndata for c in chunks)
    one = run(plan.one_shot(), steps_of(plan))
    assert len(one) == 1 and one[0].is_final
    assert np.array_equal(np.concatenate([c.frames for c in chunks]), one[0].frames)


def test_overlapped_assembly_drops_blends_and_holds():
    plan = overlapped_plan(8)  # two windows: 17 + 17 + 5 frames
    steps = steps_of(plan)
    frames = np.concatenate([c.frames for c in run(plan, steps)])
    w0 = np.concatenate(steps[:7])[3:]   # window 0 after dropping 3 leading frames: 22
    w1 = np.concatenate(steps[7:])[3:]
    expected = np.concatenate([w0[:17], blend(w0[17:], w1[:5]), w1[5:]])
    assert len(expected) == 17 * 2 + 5
    assert np.array_equal(frames, to_uint8(expected))
    weights = (np.arange(5) + 0.5) / 5
    mixed = blend(np.zeros((5, 1, 1, 3), np.float32), np.ones((5, 1, 1, 3), np.float32))[:, 0, 0, 0]
    assert np.allclose(mixed, weights)


def test_assembler_refuses_what_the_plan_does_not_say():
    plan = causal_plan(3)
    steps = steps_of(plan)
    assembler = Assembler(plan)
    with pytest.raises(AssertionError, match="should give 1 frames"):
        assembler.push(steps[1])
    assembler.push(steps[0])
    with pytest.raises(AssertionError, match="frame plan check failed: 1 of 3 steps"):
        assembler.finish()
    assembler.push(steps[1])
    with pytest.raises(AssertionError, match="frame size changed"):
        assembler.push(np.zeros((4, 5, 5, 3), np.float32))
    assembler.push(steps[2])
    assert assembler.finish().is_final
    with pytest.raises(AssertionError):
        assembler.push(steps[2])


def test_sent_chunks_never_change():
    """Mutation test: overwrite every input after pushing it and every later chunk after
    receiving it; chunks already out keep their values."""
    plan = overlapped_plan(13)
    assembler = Assembler(plan)
    out, copies = [], []
    for f in steps_of(plan):
        ready = assembler.push(f)
        f[...] = 0.5  # the engine reuses its buffers
        for c in out:
            assert all(not np.shares_memory(c.frames, r.frames) for r in ready)
        for r in ready:
            out.append(r)
            copies.append(r.frames.copy())
        if ready:
            ready[-1].frames[...] = 7  # a consumer scribbles on its own chunk
            copies[-1][...] = 7
    out.append(assembler.finish())
    copies.append(out[-1].frames.copy())
    for c, saved in zip(out, copies, strict=True):
        assert np.array_equal(c.frames, saved)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda c: c.pop(1), "has chunk_index 2"),
    (lambda c: c.__setitem__(1, (1, 5, 1, 4, False)), "total_chunks 5"),
    (lambda c: c.__setitem__(1, (1, 4, 2, 4, False)), "starts at frame 2"),
    (lambda c: c.__setitem__(1, (1, 4, 1, 0, False)), "is empty"),
    (lambda c: c.__setitem__(1, (1, 4, 1, 4, True)), "is_final=True"),
    (lambda c: c.__setitem__(3, (3, 4, 9, 4, False)), "is_final=False"),
    (lambda c: (c.pop(), c.__setitem__(2, (2, 4, 5, 4, True))), "3 chunks arrived, total_chunks says 4"),
])
def test_check_chunks_catches_every_violation(mutate, message):
    good = [(0, 4, 0, 1, False), (1, 4, 1, 4, False), (2, 4, 5, 4, False), (3, 4, 9, 4, True)]
    check_chunks(good, 13)
    with pytest.raises(AssertionError, match="13 frames arrived, expected 14"):
        check_chunks(good, 14)
    bad = list(good)
    mutate(bad)
    with pytest.raises(AssertionError, match=message):
        check_chunks(bad)


def test_overlap_config_matches_the_reference():
    assert (OVERLAP.window, OVERLAP.window_frames, OVERLAP.split, OVERLAP.blend) == (7, 25, 17, 5)
