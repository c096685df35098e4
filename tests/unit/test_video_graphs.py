"""The video engine's steady-state decode step through the graph runner: with a stand-in capture backend
the feature cache travels through the graph's static inputs and cloned outputs, and the frames are
bit-identical to the plain engine's; on the CPU every step is eager and counted."""

from __future__ import annotations

import numpy as np
import torch
from rtmedia.engines.graphs import GraphConfig, GraphRunner
from rtmedia.engines.video.decoder import VideoEngine

from tests.support.graphs import FakeBackend, decode_all


def test_graph_steps_are_bit_identical_and_counted() -> None:
    latent = torch.randn(16, 6, 2, 3, generator=torch.Generator().manual_seed(5))
    plain = VideoEngine()
    plain.load()
    backend = FakeBackend()
    graphed = VideoEngine(graphs=GraphRunner("video", GraphConfig(), backend))
    graphed.load()
    for _ in range(2):  # two streams of one resolution share the graph
        for a, b in zip(decode_all(plain, latent), decode_all(graphed, latent), strict=True):
            assert np.array_equal(a, b)
    stats = graphed.graphs.stats
    # per stream: steps 0-1 build the cache (eager), steps 2-5 are steady; the 2nd steady call captures
    assert stats.misses["ineligible"] == 4 and stats.misses["warmup"] == 1
    assert backend.captures == 1 and stats.hits == 7 and stats.graphs == 1
    assert plain.graphs.stats.misses["ineligible"] == 12 and plain.graphs.stats.hits == 0
