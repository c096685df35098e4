"""The torch backend of the Whisper engine (engines/asr/whisper_torch.py): the CTranslate2 weights'
mapping, and agreement with CTranslate2 (float32) on the embedded tiny.en — encoder states,
decoder scores, alignments, and the engine's text and word times on Piper speech; a random
transformers Whisper directory loads and matches transformers' own forward."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from rtmedia.engines.asr.contract import AsrItem
from rtmedia.engines.asr.whisper import WhisperEngine
from rtmedia.engines.asr.whisper_ct2 import CTranslate2Backend
from rtmedia.engines.asr.whisper_model import Vocabulary, embedded_model_dir, log_mel, window_frames
from rtmedia.engines.asr.whisper_torch import TorchBackend, negative_dtw, read_ctranslate2
from rtmedia.engines.base import EngineError

from tests.support.speech import Speaker
from tests.support.whisper_models import tiny_whisper

FOX = "The quick brown fox jumps over the lazy dog."
SPIDER = "How many legs does a spider have?"
EGG = "How many minutes does it take to boil an egg?"
CALL = "Please call Stella and ask her to bring these things with her from the store."


@pytest.fixture(scope="module")
def backends() -> tuple[TorchBackend, CTranslate2Backend]:
    return TorchBackend(threads=1), CTranslate2Backend(embedded_model_dir(), compute_type="float32",
                                                       intra_threads=1, inter_threads=1)


@pytest.fixture(scope="module")
def speech() -> dict[str, np.ndarray]:
    speaker = Speaker()
    return {text: speaker.say(text) for text in (FOX, SPIDER, EGG, CALL)}


@pytest.fixture(scope="module")
def features(speech) -> np.ndarray:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000)
    audio = [speech[t].astype(np.float32) / 32768 for t in (FOX, SPIDER)]
    frames = window_frames(max(a.size for a in audio))
    return np.stack([log_mel(a, frames, extractor) for a in audio])


def test_model_bin_is_read_whole() -> None:
    variables = read_ctranslate2(embedded_model_dir() / "model.bin")
    assert variables["decoder/embeddings/weight"].shape == (51864, 384)
    assert variables["decoder/projection/weight"] is variables["decoder/embeddings/weight"]  # the alias
    qkv = variables["encoder/layer_0/self_attention/linear_0/bias"]
    assert qkv.shape == (1152,) and not qkv[384:768].any()  # the key has no bias


def test_encoder_states_agree(backends, features) -> None:
    torch_backend, ct2 = backends
    ours = torch_backend.encode(features).numpy()
    theirs = np.array(ct2.encode(features))
    assert ours.shape == theirs.shape == (2, features.shape[-1] // 2, 384)
    np.testing.assert_allclose(ours, theirs, atol=2e-3)


def test_decodes_agree(backends, features) -> None:
    """Tokens, scores and no-speech probabilities, with and without previous text."""
    torch_backend, ct2 = backends
    vocab = Vocabulary(embedded_model_dir())
    encoded = ct2.encode(features)
    for prompt in (vocab.start, vocab.prompt(vocab.encode("Hello there, how are you?"))):
        ours = torch_backend.generate(torch.from_numpy(np.array(encoded)), [prompt] * 2, [30, 30])
        theirs = ct2.generate(encoded, [prompt] * 2, [30, 30])
        for a, b in zip(ours, theirs, strict=True):
            assert a.tokens == b.tokens
            assert a.avg_logprob == pytest.approx(b.avg_logprob, abs=1e-4)
            assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-4)
    assert vocab.decode(ours[1].tokens) == SPIDER


def test_decoder_logits_agree(backends, features) -> None:
    """The logits of every step of a decode (CTranslate2's `return_logits_vocab`)."""
    torch_backend, ct2 = backends
    vocab = Vocabulary(embedded_model_dir())
    encoded = ct2.encode(features)
    result = ct2.model.generate(encoded, [vocab.start] * 2, beam_size=1, max_length=12, return_logits_vocab=True)
    theirs = np.array([np.array(step) for step in result[1].logits[0]])
    ids = torch.tensor([[*vocab.start, *result[1].sequences_ids[0]]])
    with torch.inference_mode():
        cross = torch_backend._cross(torch.from_numpy(np.array(encoded)[1:]))
        hidden, _ = torch_backend._decoder(ids, 0, cross, None)
        ours = torch_backend._logits(hidden)[0, 1 : 1 + len(theirs)].numpy()
    finite = theirs > -1e30  # (suppressed tokens are the lowest float in CTranslate2's)
    np.testing.assert_allclose(ours[finite], theirs[finite], atol=2e-3)


def test_alignments_agree(backends, features, speech) -> None:
    torch_backend, ct2 = backends
    vocab = Vocabulary(embedded_model_dir())
    encoded = ct2.encode(features)
    tokens = [vocab.encode(FOX), vocab.encode(SPIDER)]
    frames = [speech[FOX].size // 160, speech[SPIDER].size // 160]
    ours = torch_backend.align(torch.from_numpy(np.array(encoded)), vocab.sot_sequence(), tokens, frames)
    theirs = ct2.align(encoded, vocab.sot_sequence(), tokens, frames)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a.text_token_probs, b.text_token_probs, atol=1e-3)
        path, other = np.array(a.alignments), np.array(b.alignments)
        starts = [path[path[:, 0] == i, 1].min() for i in range(len(a.text_token_probs))]
        other_starts = [other[other[:, 0] == i, 1].min() for i in range(len(a.text_token_probs))]
        assert np.abs(np.array(starts) - np.array(other_starts)).max() <= 1


def test_negative_dtw_follows_the_strongest_attention() -> None:
    """Each token's row holds its columns; the path walks them, one token after the other."""
    x = np.full((3, 6), -1, np.float32)
    x[0, :2] = x[1, 2:4] = x[2, 4:] = 1
    assert negative_dtw(x) == [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)]


def _final(engine: WhisperEngine, pcm: np.ndarray):
    stream = engine.open_stream(partials=False)
    engine.step([AsrItem(stream, pcm.tobytes())])
    [[final]] = engine.step([AsrItem(stream, b"", end=True)], urgent=True)
    engine.close_stream(stream)
    return final


@pytest.fixture(scope="module")
def engines(backends) -> Iterator[tuple[WhisperEngine, WhisperEngine]]:
    pair = (WhisperEngine(backend=backends[0]), WhisperEngine(backend=backends[1]))
    for engine in pair:
        engine.load()
    yield pair
    for engine in pair:
        engine.close()


@pytest.mark.parametrize("text", [FOX, EGG, CALL])
def test_engine_text_and_word_times_agree(engines, speech, text) -> None:
    """No word differs on these sentences; word times within two encoder positions (40 ms)."""
    ours, theirs = (_final(engine, speech[text]) for engine in engines)
    assert ours.text == theirs.text
    assert [w[0] for w in ours.words] == [w[0] for w in theirs.words]
    for a, b in zip(ours.words, theirs.words, strict=True):
        assert abs(a[1] - b[1]) <= 40 and abs(a[2] - b[2]) <= 40
        assert a[3] == pytest.approx(b[3], abs=1e-3)
    assert ours.no_speech_prob == pytest.approx(theirs.no_speech_prob, abs=1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random transformers Whisper directory (no download) with the embedded tokenizer."""
    return tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))


def test_transformers_directory_loads(tiny) -> None:
    """A transformers directory loads, and this module's forward passes (trimmed windows, KV
    cache) match transformers' own on a full window."""
    from transformers import WhisperForConditionalGeneration

    backend = TorchBackend(tiny, threads=1)
    reference = WhisperForConditionalGeneration.from_pretrained(tiny).eval()
    features = np.random.default_rng(0).standard_normal((1, 80, 3000)).astype(np.float32)
    vocab = Vocabulary(embedded_model_dir())
    ids = torch.tensor([[*vocab.start, 1000, 2000, 3000]])
    with torch.inference_mode():
        expected = reference(torch.from_numpy(features), decoder_input_ids=ids)
        encoded = backend.encode(features)
        np.testing.assert_allclose(encoded.numpy(), expected.encoder_last_hidden_state.numpy(), atol=1e-4)
        hidden, _ = backend._decoder(ids, 0, backend._cross(encoded), None)
        np.testing.assert_allclose(backend._logits(hidden).numpy(), expected.logits.numpy(), atol=1e-3)
    short = backend.encode(features[:, :, :300])
    assert short.shape == (1, 150, 64)
    [decoded] = backend.generate(short, [vocab.start], [5])
    assert len(decoded.tokens) <= 5 and 0 <= decoded.no_speech_prob <= 1
    [aligned] = backend.align(short, vocab.sot_sequence(), [[1000, 2000]], [300])
    assert len(aligned.text_token_probs) == 2 and aligned.alignments[-1] == (2, 149)


@pytest.mark.parametrize("quantization", ["float32", "int8"])
def test_a_converted_model_loads_in_both_backends(tiny, tmp_path, quantization) -> None:
    """CTranslate2's converter's output of the tiny model: the torch backend reads it (int8
    dequantised) and agrees with CTranslate2 in float32 on encoder states and decodes."""
    import ctranslate2

    ctranslate2.converters.TransformersConverter(str(tiny)).convert(str(tmp_path / "ct2"), quantization=quantization)
    ours = TorchBackend(tmp_path / "ct2", threads=1)
    theirs = CTranslate2Backend(tmp_path / "ct2", compute_type="float32", intra_threads=1, inter_threads=1)
    features = np.random.default_rng(1).standard_normal((2, 80, 300)).astype(np.float32)
    encoded = theirs.encode(features)
    np.testing.assert_allclose(ours.encode(features).numpy(), np.array(encoded), atol=1e-4)
    start = Vocabulary(embedded_model_dir()).start
    for a, b in zip(ours.generate(torch.from_numpy(np.array(encoded)), [start] * 2, [10, 10]),
                    theirs.generate(encoded, [start] * 2, [10, 10]), strict=True):
        assert a.tokens == b.tokens
        assert a.avg_logprob == pytest.approx(b.avg_logprob, abs=1e-3)
        assert a.no_speech_prob == pytest.approx(b.no_speech_prob, rel=1e-3)


def test_a_directory_that_is_no_whisper_fails(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(EngineError, match="not a Whisper model"):
        TorchBackend(tmp_path)
