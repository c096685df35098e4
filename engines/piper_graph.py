"""A Piper voice's HiFi-GAN decoder rewritten as 2-D convolutions.

Piper's VITS graph spends ~70 % of a synthesis in its decoder (`/dec/...`):
1-D convolutions over the audio-rate signal with 32-256 channels. onnxruntime
runs a 1-D convolution as im2col + GEMM, but a 2-D one over [batch, C, 1, L]
in its blocked NCHWc layout with direct kernels, which is ~1.3-2x faster for
these shapes on one thread. The rewrite adds a unit height axis at the
decoder's input, gives every convolution in it a [1, k] kernel (weights
[O, I, 1, k], pads, strides, dilations and output padding likewise) and
removes the axis at the decoder's output; the decoder's other ops (LeakyRelu,
Add, Div by a scalar, Tanh) do not depend on the rank. The result is the same
computation on the same weights (audio equal to the original within ~1e-6).

A graph whose decoder does not have that shape (other ops, several inputs or
outputs, non-scalar constants) is left as it is: `decoder_2d` returns None.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DECODER = "/dec/"
_CONVS = ("Conv", "ConvTranspose")
_RANK_FREE = ("LeakyRelu", "Add", "Div", "Tanh")


def _boundary(graph: Any, nodes: list[Any], initializers: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Tensors entering the decoder from the rest of the graph, and tensors leaving it."""
    made = {out for node in nodes for out in node.output}
    inside = {id(node) for node in nodes}
    entering = sorted({t for node in nodes for t in node.input if t and t not in made and t not in initializers})
    used_outside = {t for node in graph.node if id(node) not in inside for t in node.input}
    used_outside |= {o.name for o in graph.output}
    return entering, sorted(made & used_outside)


def decoder_2d(path: str) -> bytes | None:
    """The serialized model with its decoder's convolutions in 2-D, or None if the decoder
    is not the HiFi-GAN layout this rewrite knows."""
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
    shared = {t for node in graph.node if not node.name.startswith(DECODER) for t in node.input}
    for node in nodes:
        if node.op_type not in _CONVS:
            continue
        weight = node.input[1]
        if weight not in initializers or weight in shared or len(initializers[weight].dims) != 3:
            return None
        w = numpy_helper.to_array(initializers[weight])
        initializers[weight].CopyFrom(numpy_helper.from_array(w[:, :, None, :], weight))
        for attr in node.attribute:
            values = list(attr.ints)
            if attr.name == "pads":
                values = [0, values[0], 0, values[1]]
            elif attr.name in ("kernel_shape", "strides", "dilations", "output_padding"):
                values = [1 if attr.name != "output_padding" else 0, *values]
            else:
                continue
            del attr.ints[:]
            attr.ints.extend(values)
    (source,), (result,) = entering, leaving
    rename = {source: source + "_2d", result: result + "_2d"}
    for node in nodes:
        node.input[:] = [rename.get(t, t) for t in node.input]
        node.output[:] = [rename.get(t, t) for t in node.output]
    graph.initializer.append(numpy_helper.from_array(np.array([2], np.int64), "decoder_height_axis"))
    order = list(graph.node)
    producer = next(i for i, node in enumerate(order) if rename[result] in node.output)
    graph.node.insert(producer + 1, helper.make_node(
        "Squeeze", [rename[result], "decoder_height_axis"], [result], name=DECODER + "to_1d"))
    consumer = next(i for i, node in enumerate(order) if rename[source] in node.input)
    graph.node.insert(consumer, helper.make_node(
        "Unsqueeze", [source, "decoder_height_axis"], [rename[source]], name=DECODER + "to_2d"))
    kept = [info for info in graph.value_info if not info.name.startswith(DECODER)]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    onnx.checker.check_model(model)
    return model.SerializeToString()

