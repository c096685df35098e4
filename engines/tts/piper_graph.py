"""A Piper voice's graph split in two: phonemes -> latent frames, and a HiFi-GAN
decoder (latent frames -> audio) rewritten as 2-D convolutions.

Piper's VITS graph spends most of a synthesis in its decoder (`/dec/...`):
1-D convolutions over the audio-rate signal with 32-256 channels. onnxruntime
runs a 1-D convolution as im2col + GEMM, but a 2-D one over [batch, C, 1, L]
in its blocked NCHWc layout with direct kernels, which is faster for these
shapes on one thread (BENCHMARKS.md). The rewrite adds a unit height axis at the
decoder's input, gives every convolution in it a [1, k] kernel (weights
[O, I, 1, k], pads, strides, dilations and output padding likewise) and
removes the axis at the decoder's output; the decoder's other ops (LeakyRelu,
Add, Div by a scalar, Tanh) do not depend on the rank. The result is the same
computation on the same weights (audio equal to the original to float rounding).

The split also lets a long sentence be decoded in windows (engines/tts/piper.py):
the decoder is convolutional, so a window of latent frames decoded with
`CONTEXT_FRAMES` frames of context on each side gives exactly the samples the
whole-sentence decode gives for it, and the first audio of a sentence is
ready after the latent pass and one short window instead of the whole decode.

A graph whose decoder does not have that shape (other ops, several inputs or
outputs, non-scalar constants) is not split: `split` returns None.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rtmedia.engines.disk_cache import cached_folder, content_key

DECODER = "/dec/"
_CONVS = ("Conv", "ConvTranspose")
_RANK_FREE = ("LeakyRelu", "Add", "Div", "Tanh")
# Latent frames of context decoded on each side of a window: the decoder's receptive field
# (with 9 a window differed visibly from the whole decode, with 10 only by float rounding;
# tests/unit/test_piper_graph.py checks windows against whole decodes).
CONTEXT_FRAMES = 10
# The format of a split kept on disk (split_cached): raised whenever `split` changes its output.
SPLIT_VERSION = 1


@dataclass(frozen=True)
class PiperParts:
    """The two halves of a voice graph, serialized."""

    latent: bytes  # the voice graph's inputs -> "latent" [1, channels, frames]
    decoder: bytes  # "latent" [1, channels, frames] -> "audio" [1, 1, frames * hop]
    hop: int  # audio samples per latent frame


def _boundary(graph: Any, nodes: list[Any], initializers: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Tensors entering the decoder from the rest of the graph, and tensors leaving it."""
    made = {out for node in nodes for out in node.output}
    inside = {id(node) for node in nodes}
    entering = sorted({t for node in nodes for t in node.input if t and t not in made and t not in initializers})
    used_outside = {t for node in graph.node if id(node) not in inside for t in node.input}
    used_outside |= {o.name for o in graph.output}
    return entering, sorted(made & used_outside)


def split(path: str) -> PiperParts | None:
    """The voice graph at `path` as a latent graph and a 2-D decoder graph, or None if
    its decoder is not the HiFi-GAN layout this rewrite knows."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(path)
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    nodes = [node for node in graph.node if node.name.startswith(DECODER)]
    if not nodes or any(node.op_type not in _CONVS + _RANK_FREE for node in nodes):
        return None
    entering, leaving = _boundary(graph, nodes, initializers)
    if len(entering) != 1 or len(leaving) != 1:
        return None
    for node in nodes:
        if node.op_type in _RANK_FREE and any(
                t in initializers and np.prod(initializers[t].dims) != 1 for t in node.input):
            return None  # a constant that broadcasts by rank would change meaning
    (source,), (result,) = entering, leaving
    needed, kept = {source}, []  # the nodes the decoder's input depends on, last first
    for node in reversed(graph.node):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(node.input)
    hop = 1
    for node in nodes:
        if node.op_type not in _CONVS:
            continue
        if node.input[1] not in initializers or len(initializers[node.input[1]].dims) != 3:
            return None
        for attr in node.attribute:
            values = list(attr.ints)
            if attr.name == "pads":
                values = [0, values[0], 0, values[1]]
            elif attr.name in ("kernel_shape", "strides", "dilations", "output_padding"):
                if attr.name == "strides" and node.op_type == "ConvTranspose":
                    hop *= values[0]
                values = [1 if attr.name != "output_padding" else 0, *values]
            else:
                continue
            del attr.ints[:]
            attr.ints.extend(values)
    rename = {source: "latent_2d", result: "audio_2d"}
    for node in nodes:
        node.input[:] = [rename.get(t, t) for t in node.input]
        node.output[:] = [rename.get(t, t) for t in node.output]
    used = {t for node in nodes for t in node.input}
    weights = []
    for name in sorted(used & initializers.keys()):
        w = numpy_helper.to_array(initializers[name])
        weights.append(numpy_helper.from_array(w[:, :, None, :] if w.ndim == 3 else w, name))
    axis = numpy_helper.from_array(np.array([2], np.int64), "height_axis")
    first = next(node for node in nodes if "latent_2d" in node.input)
    if first.op_type != "Conv":
        return None
    channels = initializers[first.input[1]].dims[1]
    decoder = helper.make_graph(
        [helper.make_node("Unsqueeze", ["latent", "height_axis"], ["latent_2d"]), *nodes,
         helper.make_node("Squeeze", ["audio_2d", "height_axis"], ["audio"])],
        "piper_decoder_2d",
        [helper.make_tensor_value_info("latent", onnx.TensorProto.FLOAT, [1, channels, "frames"])],
        [helper.make_tensor_value_info("audio", onnx.TensorProto.FLOAT, [1, 1, "samples"])],
        [*weights, axis])
    latent = helper.make_graph(
        kept[::-1], "piper_latent", [i for i in graph.input if i.name in needed],
        [helper.make_tensor_value_info(source, onnx.TensorProto.FLOAT, [1, channels, "frames"])],
        [init for name, init in initializers.items() if name in needed])
    parts = []
    for graph_part in (latent, decoder):
        part = helper.make_model(graph_part, opset_imports=model.opset_import)
        part.ir_version = model.ir_version
        onnx.checker.check_model(part)
        parts.append(part.SerializeToString())
    return PiperParts(parts[0], parts[1], hop)


def split_cached(path: str, cache_dir: Path | None = None) -> PiperParts | None:
    """`split(path)`, kept on disk (engines/disk_cache.py) under a hash of the voice file, so a
    server start after the first reads the two graphs instead of loading and rewriting the
    voice's ONNX graph again."""
    made: list[PiperParts | None] = []

    def build(folder: Path) -> None:
        made.append(split(path))
        parts = made[0]
        if parts is None:
            (folder / "whole").write_text("this voice's decoder is not split\n")
            return
        (folder / "latent.onnx").write_bytes(parts.latent)
        (folder / "decoder.onnx").write_bytes(parts.decoder)
        (folder / "hop").write_text(f"{parts.hop}\n")

    try:
        folder = cached_folder(f"piper-split-{content_key(Path(path), SPLIT_VERSION)}", build, cache_dir)
    except OSError:
        folder = None
    if made:
        return made[0]
    if folder is None:
        return split(path)
    if (folder / "whole").exists():
        return None
    return PiperParts((folder / "latent.onnx").read_bytes(), (folder / "decoder.onnx").read_bytes(),
                      int((folder / "hop").read_text()))
