"""semantic_vad's scorers (engines/turn/scorers.py). The text scorer on the embedded SmolLM2 (int8, as
the server runs it): every finished transcript of tests/support/turn_texts.py scores above the
medium eagerness's first threshold and every unfinished one below it (AUC 1), with and without
an assistant message before them. The acoustic scorer's features equal the reference
implementation's (pipecat's vendored Whisper features on audio zero-padded at the start), and
a file of another contract is refused by name."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from rtmedia.engines.base import EngineError
from rtmedia.engines.lm.engine import EmbeddedLmEngine
from rtmedia.engines.turn.scorers import AcousticTurnModel, TurnPrompt, smart_turn_input, smart_turn_path
from rtmedia.server.hearing.semantic_turns import THRESHOLDS, threshold

from tests.support.turn_texts import FINISHED, UNFINISHED


@pytest.fixture(scope="module")
def scorer():
    engine = EmbeddedLmEngine(slots=1, context=256, quantize="int8", threads=1)
    engine.load()
    prompt = TurnPrompt.of(engine.tokenizer)

    def score(words: str, assistant: str = "") -> float:
        slot = engine.acquire()
        try:
            return prompt.score(engine.prefill(slot, prompt.ids(assistant, words)))
        finally:
            engine.release(slot)

    yield score
    engine.close()


def auc(finished: list[float], unfinished: list[float]) -> float:
    return sum((f > u) + 0.5 * (f == u) for f in finished for u in unfinished) / (len(finished) * len(unfinished))


@pytest.mark.parametrize("assistant", ["", "Hello! How can I help you today?"])
def test_finished_transcripts_score_above_the_medium_threshold_and_unfinished_below(scorer, assistant):
    assert len(FINISHED) >= 20 and len(UNFINISHED) >= 20
    finished = [scorer(text, assistant) for text in FINISHED]
    unfinished = [scorer(text, assistant) for text in UNFINISHED]
    medium = threshold("medium", 200)
    low = [t for t, s in zip(FINISHED, finished, strict=True) if s < medium]
    high = [t for t, s in zip(UNFINISHED, unfinished, strict=True) if s >= medium]
    assert not low and not high, (low, high)
    assert auc(finished, unfinished) == 1.0


def test_thresholds_fall_as_the_silence_grows_and_auto_is_medium():
    for eagerness, (first, mid, late) in THRESHOLDS.items():
        assert first > mid > late
        assert [threshold(eagerness, ms) for ms in (200, 599, 600, 1499, 1500)] == [first, first, mid, mid, late]
    assert threshold("auto", 700) == threshold("medium", 700)
    assert THRESHOLDS["low"][0] > THRESHOLDS["medium"][0] > THRESHOLDS["high"][0]


def _reference_features():
    """pipecat's own feature code, loaded from its file (importing pipecat would pull its
    dependencies)."""
    path = smart_turn_path().parent.parent / "_whisper_features.py"
    spec = importlib.util.spec_from_file_location("smart_turn_reference_features", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_whisper_log_mel_features


def test_acoustic_features_equal_the_reference_implementation(speaker):
    reference = _reference_features()
    model = AcousticTurnModel()
    model.load()
    short = speaker.float_audio("Please set a timer for ten minutes.")
    long = np.concatenate([short] * 5)  # over 8 s: only the last 8 s count
    for audio in (short, long):
        ours = model.features(audio)
        theirs = reference(smart_turn_input(audio), do_normalize=True)[None]
        assert ours.shape == (1, 80, 800)
        diff = np.abs(ours - theirs)
        assert diff.max() <= 1e-4 and diff.mean() <= 1e-6, (diff.max(), diff.mean())  # float32 rounding
    assert 0.0 <= model.score(short) <= 1.0


def test_an_acoustic_model_of_another_contract_is_refused(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not an onnx file")
    with pytest.raises(EngineError, match="turn audio model"):
        AcousticTurnModel(bad).load()
