"""Whisper models a deployment brings (engines/asr/whisper.py `WhisperEngine(model_dir, runtime)`):
tiny random transformers Whisper directories (English-only, multilingual, 128 log-mel bins),
their CTranslate2 conversions, the languages a multilingual model takes or detects, the
one-line errors of directories that are no Whisper model; and the torch backend's static KV
cache and CUDA-graph bookkeeping on a CPU, through the graph runner with a stand-in capture
backend (tests/support/graphs.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from rtmedia.engines.asr.contract import AsrItem
from rtmedia.engines.asr.whisper import WhisperEngine
from rtmedia.engines.asr.whisper_model import Vocabulary, embedded_model_dir, log_mel, window_frames
from rtmedia.engines.asr.whisper_torch import TorchBackend, padded_batch
from rtmedia.engines.base import EngineError
from rtmedia.engines.graphs import GraphConfig, GraphRunner

from tests.support.graphs import FakeBackend
from tests.support.speech import Speaker
from tests.support.whisper_models import tiny_whisper

SPIDER = "How many legs does a spider have?"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    """English-only and multilingual tiny models, and a CTranslate2 conversion of the first."""
    import ctranslate2

    root = tmp_path_factory.mktemp("whisper-models")
    english = tiny_whisper(root / "tiny-en")
    ctranslate2.converters.TransformersConverter(str(english), copy_files=["tokenizer.json"]).convert(
        str(root / "tiny-en-ct2"), quantization="int8")
    multilingual = tiny_whisper(root / "tiny-multi", multilingual=True)
    ctranslate2.converters.TransformersConverter(str(multilingual), copy_files=["tokenizer.json"]).convert(
        str(root / "tiny-multi-ct2"))
    return {"english": english, "english-ct2": root / "tiny-en-ct2",
            "multilingual": multilingual, "multilingual-ct2": root / "tiny-multi-ct2",
            "mels128": tiny_whisper(root / "tiny-128", multilingual=True, mels=128, seed=1)}


@pytest.fixture(scope="module")
def spider() -> bytes:
    return Speaker().say(SPIDER).tobytes()


def _final(engine: WhisperEngine, pcm: bytes, language: str = ""):
    stream = engine.open_stream(partials=False, language=language)
    try:
        engine.step([AsrItem(stream, pcm)])
        [[final]] = engine.step([AsrItem(stream, b"", end=True)], urgent=True)
    finally:
        engine.close_stream(stream)
    return final


class Recording(TorchBackend):
    """The torch backend, keeping the prompts it was asked to decode."""

    prompts: list[list[int]]

    def generate(self, encoded, prompts, max_tokens):
        self.prompts = getattr(self, "prompts", []) + prompts
        return super().generate(encoded, prompts, max_tokens)


def test_an_english_model_in_both_runtimes(models, spider) -> None:
    """The CTranslate2 conversion in either runtime, the transformers directory in torch: one
    model, one name, English only; a final in English."""
    for directory, runtime in ((models["english-ct2"], "ct2"), (models["english-ct2"], "torch"),
                               (models["english"], "torch")):
        engine = WhisperEngine(directory, runtime=runtime)
        engine.load()
        assert engine.model == directory.name and engine.languages == ("en",)
        assert engine.describe["runtime"] == runtime
        assert _final(engine, spider, "en-US").language == "en"
        with pytest.raises(ValueError, match=r"'fr' is not served.*English-only"):
            engine.open_stream(language="fr")
        engine.close()


def test_a_multilingual_model_takes_the_language_asked_for(models, spider) -> None:
    """`fr-FR`, `french` and `fr` are French: the prompt names it and the final carries it."""
    backend = Recording(models["multilingual"], threads=1)
    engine = WhisperEngine(models["multilingual"], backend=backend)
    engine.load()
    vocab = Vocabulary(models["multilingual"], multilingual=True)
    assert backend.multilingual and len(engine.languages) == 99 and {"fr", "he"} <= set(engine.languages)
    for asked in ("fr-FR", "french", "fr"):
        backend.prompts = []
        assert _final(engine, spider, asked).language == "fr"
        assert backend.prompts[0][-4:] == [*vocab.sot_sequence("fr"), vocab.no_timestamps]
        assert vocab.sot_sequence("fr") == [vocab.sot, vocab._tokenizer.token_to_id("<|fr|>"), vocab.transcribe]
    assert vocab.sot_sequence("he")[1] == vocab._tokenizer.token_to_id("<|iw|>")  # Hebrew's token
    with pytest.raises(ValueError, match="'klingon' is not served by this recogniser; it serves 99 languages"):
        engine.open_stream(language="klingon")


def test_a_multilingual_model_detects_the_language(models, spider) -> None:
    """No language asked: the one Whisper finds most probable on the window, in the prompt and
    the final."""
    backend = Recording(models["multilingual"], threads=1)
    engine = WhisperEngine(models["multilingual"], backend=backend)
    engine.load()
    final = _final(engine, spider)
    features = log_mel(np.frombuffer(spider, "<i2").astype(np.float32) / 32768, window_frames(len(spider) // 2),
                       engine._extractor)[None]
    [token] = backend.detect_language(backend.encode(features))
    vocab = Vocabulary(models["multilingual"], multilingual=True)
    assert final.language == vocab.code_of(token) and final.language in engine.languages
    assert backend.prompts[0][-3] == vocab._tokenizer.token_to_id(token)


def test_a_multilingual_model_in_both_runtimes(models, spider) -> None:
    """The converted multilingual model: CTranslate2 (float32) and torch detect the same language
    and hear the same tokens, with a language asked for and without."""
    engines = [WhisperEngine(models["multilingual-ct2"], runtime="ct2", compute_type="float32"),
               WhisperEngine(models["multilingual-ct2"], runtime="torch")]
    for engine in engines:
        engine.load()
        assert engine.describe["languages"] == "multilingual" and len(engine.languages) == 99
    for asked in ("", "de"):
        ct2, torch_ = (_final(engine, spider, asked) for engine in engines)
        assert ct2.language == torch_.language == (asked or ct2.language) and ct2.language
        assert ct2.tokens and [t for t, _, _ in ct2.tokens] == [t for t, _, _ in torch_.tokens]


def test_int8_linears_on_a_cpu(spider) -> None:
    """The torch backend's int8 path (every linear layer per-row int8) hears the sentence."""
    engine = WhisperEngine(runtime="torch", compute_type="int8")
    engine.load()
    assert engine.describe["compute_type"] == "int8"
    assert _final(engine, spider).text == SPIDER


def test_128_mel_bins(models, spider) -> None:
    """large-v3's 128 log-mel bins: the features follow the model's encoder."""
    engine = WhisperEngine(models["mels128"], runtime="torch")
    engine.load()
    assert engine._extractor.feature_size == 128
    assert engine.describe["languages"] == "multilingual"
    assert _final(engine, spider, "en").language == "en"


def test_directories_that_are_no_whisper_model_fail_in_one_line(models, tmp_path) -> None:
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    shutil.copytree(models["english-ct2"], tmp_path / "no-tokenizer")
    (tmp_path / "no-tokenizer" / "tokenizer.json").unlink()
    cases = {
        tmp_path / "missing": "missing: no such directory",
        tmp_path / "empty": "empty: not a Whisper model: no model.bin",
        tmp_path / "bert": r"bert/config.json: model_type is 'bert', not whisper",
        tmp_path / "broken": r"broken/config.json: not a JSON object",
        tmp_path / "no-tokenizer": r"no-tokenizer/tokenizer.json: no such file",
    }
    for directory, message in cases.items():
        with pytest.raises(EngineError, match=message) as caught:
            WhisperEngine(directory, runtime="torch")
        assert "\n" not in str(caught.value)
    with pytest.raises(EngineError, match="a transformers Whisper directory; the ct2 backend reads CTranslate2"):
        WhisperEngine(models["english"], runtime="ct2")
    with pytest.raises(EngineError, match="'int4': the torch backend runs float32, float16, bfloat16, int8"):
        WhisperEngine(models["english"], runtime="torch", compute_type="int4").load()
    with pytest.raises(EngineError, match="'int8' is the torch backend's CPU path"):
        WhisperEngine(runtime="torch", device="cuda", compute_type="int8").load()
    with pytest.raises(ValueError, match="runtime 'onnx'"):
        WhisperEngine(runtime="onnx")


def test_serve_refuses_a_bad_model_in_one_line(tmp_path) -> None:
    """`rtmedia serve --asr-model` with a directory that is no Whisper model: one line, no
    traceback, before anything listens."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    done = subprocess.run([sys.executable, "-m", "rtmedia.server.cli", "serve", "--port", "0", "--no-llm",
                           "--asr-model", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == f"rtmedia serve: asr_model: {tmp_path / 'config.json'}: model_type is 'llama', not " \
                        "whisper: not a Whisper model", done.stderr
    assert "Traceback" not in done.stderr


# -- the static KV cache and the graph runner (CPU) --------------------------------------------

@pytest.fixture(scope="module")
def windows() -> np.ndarray:
    from transformers import WhisperFeatureExtractor

    speaker = Speaker()
    audio = [speaker.say(t).astype(np.float32) / 32768 for t in
             (SPIDER, "The quick brown fox jumps over the lazy dog.", "Hello there.")]
    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000)
    frames = window_frames(max(a.size for a in audio))
    return np.stack([log_mel(a, frames, extractor) for a in audio])


@pytest.fixture(scope="module")
def eager() -> TorchBackend:
    return TorchBackend(threads=1)


def _graphed(**config) -> tuple[TorchBackend, GraphRunner, FakeBackend]:
    fake = FakeBackend()
    runner = GraphRunner("asr", GraphConfig(min_free_bytes=0, eager_after_failure=True, **config), fake)
    return TorchBackend(threads=1, graphs=runner, static=True), runner, fake


def _decode(backend: TorchBackend, windows: np.ndarray, rows: int):
    vocab = Vocabulary(embedded_model_dir())
    encoded = backend.encode(windows[:rows])
    return [(d.tokens, round(d.avg_logprob, 4), round(d.no_speech_prob, 4))
            for d in backend.generate(encoded, [vocab.start] * rows, [30] * rows)]


def test_padded_batches() -> None:
    assert [padded_batch(n) for n in (1, 2, 3, 5, 8, 9, 16, 17)] == [1, 2, 4, 8, 8, 16, 16, 17]


def test_static_decoding_matches_the_growing_cache(eager, windows) -> None:
    static = TorchBackend(threads=1, static=True)
    assert _decode(static, windows, 3) == _decode(eager, windows, 3)


def test_graphs_replay_the_encoder_and_the_decoder_step(eager, windows) -> None:
    """A batch of 3 runs as 4 (padding rows dropped): the encoder and the decoder step are
    captured on their second call and replayed after, with the eager backend's results; the
    step's buffers are kept with its graph."""
    backend, runner, fake = _graphed(max_graphs=8)
    expected = _decode(eager, windows, 3)
    assert _decode(backend, windows, 3) == expected  # encoder: a warm-up miss; decoder: captured
    assert _decode(backend, windows, 3) == expected  # encoder captured, decoder replayed
    assert runner.stats.captures == fake.captures == 2
    assert runner.has_tag("encoder") and len(backend._states) == 1
    [(batch, positions, length)] = backend._states
    assert runner.has_tag(("decoder", batch, positions, length))
    assert batch == 4 and positions == windows.shape[-1] // 2 and length % 64 == 0
    assert runner.stats.hits > 20 and runner.stats.misses["warmup"] == 2


def test_graphs_beyond_the_cap_run_eagerly(eager, windows) -> None:
    backend, runner, _ = _graphed(max_graphs=1)
    for rows in (1, 1, 2, 2):
        assert _decode(backend, windows, rows) == _decode(eager, windows, rows)
    assert runner.stats.graphs == 1 and runner.stats.misses["capacity"] > 0


def test_a_failed_capture_never_fails_a_decode(eager, windows) -> None:
    backend, runner, fake = _graphed(max_graphs=8)
    fake.fail = RuntimeError("capture refused")
    assert _decode(backend, windows, 2) == _decode(eager, windows, 2)
    assert runner.failed and runner.stats.capture_failures == ["RuntimeError: capture refused"]
    assert _decode(backend, windows, 2) == _decode(eager, windows, 2)  # eager from now on
    assert runner.stats.misses["failed"] > 1 and fake.captures == 0


def test_a_busy_shape_decodes_on_buffers_of_its_own(eager, windows) -> None:
    """Two decodes of one shape at once: the second runs eagerly on its own buffers."""
    backend, runner, _ = _graphed(max_graphs=8)
    _decode(backend, windows, 2)
    [state] = backend._states.values()
    assert state.take()  # as if another decode held them
    try:
        misses = runner.stats.misses["ineligible"]
        assert _decode(backend, windows, 2) == _decode(eager, windows, 2)
        assert runner.stats.misses["ineligible"] > misses
    finally:
        state.release()


def test_engine_on_the_graphed_backend(windows) -> None:
    """The whole engine over a graphed torch backend: the same final as CTranslate2 float32."""
    backend, runner, _ = _graphed(max_graphs=8)
    engine = WhisperEngine(backend=backend)
    engine.load()
    pcm = Speaker().say(SPIDER).tobytes()
    texts = {_final(engine, pcm).text for _ in range(3)}
    assert texts == {SPIDER} and runner.stats.hits > 0
