"""CUDA behaviour of the graph runner and the engines on it (skipped without CUDA): real capture and
replay, replays follow mutated static inputs, one pool per engine and stream, the LM decode step from
graphs equals eager decode, graph-captured chunked video decode is bit-identical to eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rtmedia.engines.graphs import GraphConfig, GraphRunner
from rtmedia.engines.lm.engine import LmEngine
from rtmedia.engines.lm.synthetic import synthetic_llama
from rtmedia.engines.video.decoder import VideoEngine

from tests.support.graphs import decode_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_capture_replay_follows_inputs_and_outputs_survive() -> None:
    runner = GraphRunner("gpu-test", GraphConfig(min_free_bytes=0))
    w = torch.randn(32, 32, device="cuda")

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    xs = [torch.randn(4, 32, device="cuda") for _ in range(4)]
    outs = [runner.run(step, x) for x in xs]
    assert runner.stats.graphs == 1 and runner.stats.hits == 3 and runner.stats.misses["warmup"] == 1
    for x, out in zip(xs, outs, strict=True):
        assert torch.equal(out, step(x))  # earlier results survived later replays
    entry = next(iter(runner._graphs.values()))
    entry.inputs[0].fill_(0.5)
    entry.graph.replay()
    assert torch.equal(entry.outputs[0], step(torch.full((4, 32), 0.5, device="cuda")))
    assert len(runner._pools) == 1


def test_memory_floor_on_the_device() -> None:
    runner = GraphRunner("floor", GraphConfig(min_free_bytes=1 << 62))
    for _ in range(3):
        runner.run(torch.relu, torch.randn(8, device="cuda"))
    assert runner.stats.graphs == 0 and runner.stats.misses["memory"] == 2


def test_lm_graph_decode_equals_eager() -> None:
    model = synthetic_llama("tiny", torch.float32, "cuda")
    graphed = LmEngine(model=model, slots=8, context=128)
    eager = LmEngine(model=model, slots=8, context=128, graphs=GraphConfig(enforce_eager=True))
    for eng in (graphed, eager):
        eng.load()
        eng.warmup()
    assert graphed.static_decode and graphed.graphs.stats.pinned == len(graphed.batch_sizes)
    assert not eager.static_decode
    for eng in (graphed, eager):
        for n in range(5):
            slot = eng.acquire()
            eng.prefill(slot, list(range(1, 3 + 2 * n)))
    tokens = {s: s + 1 for s in range(5)}
    for _ in range(4):
        a, b = graphed.decode(tokens), eager.decode(tokens)
        for s in tokens:
            assert (a[s] - b[s]).abs().max().item() < 1e-3
        tokens = {s: int(a[s].argmax()) for s in tokens}
    assert graphed.graphs.stats.hits >= 4 and graphed.graphs.stats.miss_total == 0


def test_graph_video_decode_is_bit_identical_to_eager() -> None:
    latent = torch.randn(16, 7, 8, 8, generator=torch.Generator().manual_seed(0))
    graphed = VideoEngine(device="cuda", graphs=GraphConfig(min_free_bytes=0))
    eager = VideoEngine(device="cuda", graphs=GraphConfig(enforce_eager=True))
    for eng in (graphed, eager):
        eng.load()
    for _ in range(2):
        for a, b in zip(decode_all(graphed, latent), decode_all(eager, latent), strict=True):
            assert np.array_equal(a, b)
    assert graphed.graphs.stats.graphs == 1 and graphed.graphs.stats.hits >= 8
