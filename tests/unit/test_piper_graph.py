"""Piper's decoder rewritten in 2-D: the same audio as the voice's own graph, and graphs of
another layout left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from piper.config import PiperConfig, SynthesisConfig
from piper.voice import PiperVoice
from rtmedia.engines.piper_graph import decoder_2d
from rtmedia.engines.tts import default_voices


def _voice(model: str | bytes) -> PiperVoice:
    spec = default_voices()[0]
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return PiperVoice(config=PiperConfig.from_dict(spec.config), session=session)


@pytest.fixture(scope="module")
def rewritten() -> bytes:
    model = decoder_2d(str(default_voices()[0].model_path))
    assert model is not None
    return model


def test_decoder_convolutions_are_2d(rewritten: bytes) -> None:
    graph = onnx.load_from_string(rewritten).graph
    convs = [n for n in graph.node if n.name.startswith("/dec/") and n.op_type in ("Conv", "ConvTranspose")]
    others = [n for n in graph.node if not n.name.startswith("/dec/") and n.op_type == "Conv"]
    kernel = {n.name: next(a.ints for a in n.attribute if a.name == "kernel_shape") for n in convs + others}
    assert len(convs) == 23 and all(len(kernel[n.name]) == 2 and kernel[n.name][0] == 1 for n in convs)
    assert others and all(len(kernel[n.name]) == 1 for n in others)  # the rest of the graph is untouched


@pytest.mark.parametrize("text", ["Please call me back tomorrow afternoon at the office.", "Hi."])
def test_same_audio_as_the_voice_graph(rewritten: bytes, text: str) -> None:
    original, faster = _voice(str(default_voices()[0].model_path)), _voice(rewritten)
    ids = original.phonemes_to_ids(next(p for p in original.phonemize(text) if p))
    config = SynthesisConfig(normalize_audio=False)
    want, got = original.phoneme_ids_to_audio(ids, config), faster.phoneme_ids_to_audio(ids, config)
    assert len(got) == len(want) > 5000
    assert np.abs(got - want).max() < 1e-4 < np.abs(want).max()


def _graph(decoder_ops: list[str], tmp_path, name: str) -> str:
    """x -> /dec/ ops (or others) -> y, a [1, 4, 16] signal."""
    nodes, inits, x = [], [], "x"
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


def test_other_layouts_are_left_alone(tmp_path) -> None:
    small = _graph(["Conv", "LeakyRelu", "Conv", "Tanh"], tmp_path, "ok")
    x = {"x": np.random.default_rng(0).normal(size=(1, 4, 16)).astype(np.float32)}
    want, got = (onnxruntime.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, x)[0]
                 for m in (small, decoder_2d(small)))
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert decoder_2d(_graph(["Conv", "Softmax"], tmp_path, "other_op")) is None
    assert decoder_2d(_graph(["Conv", "Add4d"], tmp_path, "rank_constant")) is None
    graph = _graph([], tmp_path, "no_decoder")
    assert decoder_2d(graph) is None
