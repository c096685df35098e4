"""Piper's graph split into a latent graph and a 2-D decoder: the same audio as the voice's own
graph, windows that join into exactly the whole decode, graphs of another layout loaded
whole, and the decoder in bfloat16 close to float32."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from piper.config import PiperConfig, SynthesisConfig
from piper.voice import PiperVoice
from rtmedia.engines.tts import piper as tts_module
from rtmedia.engines.tts.piper import TtsEngine, TtsItem, default_voices, voice_from_path
from rtmedia.engines.tts.piper_bf16 import SIZES, Bf16Decoder, bf16_unavailable
from rtmedia.engines.tts.piper_graph import PiperParts, split, split_cached

from tests.support.waits import until_sync

SENTENCES = "Please call me back tomorrow afternoon at the office, and bring the report. Hi."


def _session(model: str | bytes) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def parts() -> PiperParts:
    parts = split(str(default_voices()[0].model_path))
    assert parts is not None
    return parts


needs_bf16 = pytest.mark.skipif(bool(bf16_unavailable()), reason=bf16_unavailable() or "")


def _engine(precision: str = "auto") -> TtsEngine:
    """A freshly loaded engine: Piper's graph draws noise (noise_scale), from the same seed in
    every new session, so only first syntheses of fresh engines can be compared sample by sample."""
    tts = TtsEngine(precision=precision)
    tts.load()
    return tts


def _snr_db(want: np.ndarray, got: np.ndarray) -> float:
    want, got = want.astype(float), got.astype(float)
    return float(10 * np.log10((want ** 2).sum() / ((want - got) ** 2).sum()))


def test_decoder_convolutions_are_2d(parts: PiperParts) -> None:
    decoder, latent = onnx.load_from_string(parts.decoder).graph, onnx.load_from_string(parts.latent).graph

    def kernels(graph: onnx.GraphProto) -> list[list[int]]:
        return [list(next(a.ints for a in n.attribute if a.name == "kernel_shape"))
                for n in graph.node if n.op_type in ("Conv", "ConvTranspose")]

    assert len(kernels(decoder)) == 23 and all(len(k) == 2 and k[0] == 1 for k in kernels(decoder))
    assert kernels(latent) and all(len(k) == 1 for k in kernels(latent))  # the rest of the graph as it was
    assert parts.hop == 256 == PiperConfig.from_dict(default_voices()[0].config).hop_length


def test_same_audio_as_the_voice_graph(parts: PiperParts) -> None:
    spec = default_voices()[0]
    voice = PiperVoice(config=PiperConfig.from_dict(spec.config), session=_session(str(spec.model_path)))
    latent, decoder = _session(parts.latent), _session(parts.decoder)
    c = voice.config
    for phonemes in voice.phonemize(SENTENCES):
        ids = voice.phonemes_to_ids(phonemes)
        want = voice.phoneme_ids_to_audio(ids, SynthesisConfig(normalize_audio=False))
        feeds = {"input": np.array([ids], np.int64), "input_lengths": np.array([len(ids)], np.int64),
                 "scales": np.array([c.noise_scale, c.length_scale, c.noise_w_scale], np.float32)}
        got = decoder.run(None, {"latent": latent.run(None, feeds)[0]})[0].reshape(-1)
        assert len(got) == len(want) > 5000
        assert np.abs(got - want).max() < 1e-4 < np.abs(want).max()


def _speak(engine: TtsEngine, window_frames: int, rate: int) -> tuple[list[bytes], int]:
    """The sentences as a session speaks them: the text, then windows while pending, then the
    final flush; returns each item's PCM16 and how many items had text-less windows."""
    stream = engine.open_stream(output_rate=rate, window_frames=window_frames)
    out = engine.step([TtsItem(stream, SENTENCES)])
    windows = 0
    while stream.pending:
        out += engine.step([TtsItem(stream, "")])
        windows += 1
    return out + engine.step([TtsItem(stream, "", final=True)]), windows


@pytest.mark.parametrize("rate", [22050, 16000])
def test_windows_join_into_the_whole_decode(rate: int) -> None:
    whole, none = _speak(_engine("fp32"), 0, rate)
    pieces, windows = _speak(_engine("fp32"), 16, rate)
    assert none == 0 and windows >= 3  # 16, 32, 64, ... frames: the long sentence comes in pieces
    want = np.frombuffer(b"".join(whole), np.int16).astype(int)
    got = np.frombuffer(b"".join(pieces), np.int16).astype(int)
    assert len(got) == len(want) > rate
    assert np.abs(got - want).max() <= 1  # (PCM16 rounding of float audio equal within ~1e-6)
    assert len(pieces[0]) < len(b"".join(pieces)) // 4  # the first audio is a short window
    with pytest.raises(ValueError, match="window_frames must be >= 0"):
        TtsEngine().open_stream(window_frames=-1)


@needs_bf16
@pytest.mark.parametrize("window_frames", [0, 16, 48])
def test_bfloat16_decodes_close_to_float32(window_frames: int) -> None:
    """By default (where the CPU has native bfloat16) the decoder runs in bfloat16: whole
    sentences and windows, widened or padded to the compiled sizes, are within 30 dB SNR of
    the float32 whole decode (~40 dB measured), with the same length."""
    bf16 = _engine()
    assert bf16.precision == "bf16" and isinstance(bf16._loaded(bf16.default_voice, False).decoder, Bf16Decoder)
    want = np.frombuffer(b"".join(_speak(_engine("fp32"), 0, 22050)[0]), np.int16)
    got = np.frombuffer(b"".join(_speak(bf16, window_frames, 22050)[0]), np.int16)
    assert len(got) == len(want) > 22050
    assert _snr_db(want, got) > 30


@needs_bf16
def test_bfloat16_decoder_takes_any_length_up_to_its_largest(parts: PiperParts) -> None:
    """A sentence shorter than a compiled size is padded with zero frames after its end: its
    audio is that of the float32 decoder within 30 dB SNR; longer stretches are refused."""
    decoder, reference, tts = Bf16Decoder(parts), _session(parts.decoder), _engine("fp32")
    voice = tts._loaded(tts.default_voice, False)
    latents = [latent for text in ("Hi.", "You said:", "What time does the pharmacy open in the morning?")
               for latent in tts._latents(voice, text)]
    assert latents[0].shape[2] < SIZES[0] < latents[-1].shape[2] < SIZES[-1]  # ~40, ~60, ~220 frames
    for latent in latents:
        want = reference.run(None, {"latent": latent})[0].reshape(-1)
        got = decoder.run(latent)
        assert len(got) == next(s for s in SIZES if s >= latent.shape[2]) * parts.hop
        assert _snr_db(want, got[:len(want)]) > 30
    with pytest.raises(ValueError, match="257 latent frames: the decoder takes at most 256 per call"):
        decoder.run(np.zeros((1, 192, SIZES[-1] + 1), np.float32))


def test_precision_is_checked(monkeypatch) -> None:
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16, got 'fp16'"):
        TtsEngine(precision="fp16")
    assert TtsEngine(precision="fp32").precision == "fp32"
    monkeypatch.setattr(tts_module, "bf16_unavailable", lambda: "this CPU has no native bfloat16")
    with pytest.raises(ValueError, match="precision bf16 is not available: this CPU has no native bfloat16"):
        TtsEngine(precision="bf16")
    assert TtsEngine().precision == "fp32"  # auto falls back


def _threads(engine: TtsEngine) -> list[int]:
    return [v.latent.get_session_options().intra_op_num_threads for v in engine._models[engine.default_voice]]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one thread count on a one-core machine")
def test_a_step_beside_another_runs_on_one_thread(monkeypatch) -> None:
    """By default a step that starts while another runs uses the voice's one-thread graphs
    (the same audio); a step that starts alone uses one thread per core."""
    tts = _engine()
    assert _threads(tts) == [0, 1]
    alone = tts._next_audio(tts.open_stream(), SENTENCES, crowded=False)
    beside = tts._next_audio(tts.open_stream(), SENTENCES, crowded=True)  # fresh graphs: the same noise
    assert len(alone) == len(beside) > 22050 and np.abs(alone - beside).max() < 1e-4

    seen, hold, loaded = [], threading.Event(), tts._loaded

    def held_first(name: str, crowded: bool):
        seen.append(crowded)
        if len(seen) == 1:
            hold.wait(5)
        return loaded(name, crowded)

    monkeypatch.setattr(tts, "_loaded", held_first)
    first = threading.Thread(target=tts.step, args=([TtsItem(tts.open_stream(), "One.")],))
    first.start()
    until_sync(lambda: seen, what="the first step loading its graph")
    tts.step([TtsItem(tts.open_stream(), "Two.")])  # while the first is still running
    hold.set()
    first.join()
    tts.step([TtsItem(tts.open_stream(), "Three.")])
    assert seen == [False, True, False]


def test_a_fixed_thread_count_loads_each_voice_once() -> None:
    fixed = TtsEngine(intra_op_threads=1)
    fixed.load()
    assert _threads(fixed) == [1]
    with pytest.raises(ValueError, match="intra_op_threads must be >= 0, got -1"):
        TtsEngine(intra_op_threads=-1)


def _graph(decoder_ops: list[str], tmp_path, name: str) -> str:
    """x -> /pre (Identity) -> /dec/ ops -> /out (Identity) -> y, a [1, 4, 16] signal."""
    nodes, inits, x = [helper.make_node("Identity", ["x"], ["h"], name="/pre")], [], "h"
    for i, op in enumerate(decoder_ops):
        out = f"t{i}"
        if op == "Conv":
            inits.append(numpy_helper.from_array(np.ones((4, 4, 3), np.float32), f"w{i}"))
            nodes.append(helper.make_node("Conv", [x, f"w{i}"], [out], name=f"/dec/c{i}", pads=[1, 1]))
        elif op == "Add4d":  # adds a [4, 1] constant: broadcasting depends on the rank
            inits.append(numpy_helper.from_array(np.ones((4, 1), np.float32), f"b{i}"))
            nodes.append(helper.make_node("Add", [x, f"b{i}"], [out], name=f"/dec/a{i}"))
        else:
            nodes.append(helper.make_node(op, [x], [out], name=f"/dec/{op}{i}"))
        x = out
    nodes.append(helper.make_node("Identity", [x], ["y"], name="/out"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16])], inits)
    path = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_other_layouts_are_not_split(tmp_path) -> None:
    small = _graph(["Conv", "LeakyRelu", "Conv", "Tanh"], tmp_path, "ok")
    parts = split(small)
    assert parts is not None
    x = {"x": np.random.default_rng(0).normal(size=(1, 4, 16)).astype(np.float32)}
    want = _session(small).run(None, x)[0]
    got = _session(parts.decoder).run(None, {"latent": _session(parts.latent).run(None, x)[0]})[0]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert split(_graph(["Conv", "Softmax"], tmp_path, "other_op")) is None
    assert split(_graph(["Conv", "Add4d"], tmp_path, "rank_constant")) is None
    assert split(_graph([], tmp_path, "no_decoder")) is None


def test_a_voice_that_cannot_be_split_runs_whole(tmp_path) -> None:
    """A voice graph whose decoder is not recognised (here: renamed) loads as it is, and
    decodes each sentence in one piece even on a stream that asks for windows."""
    spec = default_voices()[0]
    model = onnx.load(str(spec.model_path))
    for node in model.graph.node:
        node.name = node.name.replace("/dec/", "/vocoder/")
    path = tmp_path / "renamed.onnx"
    onnx.save(model, path)
    shutil.copy(spec.config_path, tmp_path / "renamed.onnx.json")
    other = TtsEngine([voice_from_path(path)])
    other.load()
    got, windows = _speak(other, 16, spec.native_rate)
    assert windows == 1  # two sentences, each decoded whole
    want = _speak(_engine("fp32"), 0, spec.native_rate)[0]
    assert np.abs(np.frombuffer(b"".join(got), np.int16).astype(int)
                  - np.frombuffer(b"".join(want), np.int16)).max() <= 1


def test_a_split_is_kept_on_disk_under_its_voice_file_hash(tmp_path, monkeypatch) -> None:
    """The first load splits and writes the halves; the next reads them without splitting; a
    changed voice file is split again; a voice that is not split is remembered as such; a cache
    that cannot be written only costs the split."""
    small = _graph(["Conv", "LeakyRelu", "Conv", "Tanh"], tmp_path, "ok")
    cache = tmp_path / "cache"
    made = split_cached(small, cache)
    assert made == split(small) and len(list(cache.iterdir())) == 1
    monkeypatch.setattr("rtmedia.engines.tts.piper_graph.split", lambda path: pytest.fail("split again"))
    assert split_cached(small, cache) == made
    monkeypatch.undo()
    _graph(["Conv", "LeakyRelu", "Tanh"], tmp_path, "ok")  # the same path, other content
    assert split_cached(small, cache) == split(small) != made and len(list(cache.iterdir())) == 2
    whole = _graph(["Conv", "Softmax"], tmp_path, "other_op")
    assert split_cached(whole, cache) is None and split_cached(whole, cache) is None
    (tmp_path / "locked").write_text("a file where the cache folder would be")
    assert split_cached(small, tmp_path / "locked" / "cache") == split(small)
