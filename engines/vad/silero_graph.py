"""Silero VAD's 16 kHz network rewritten as batch-wide matrix products.

The wheel's `silero_vad.onnx` computes one 576-sample window per row: a
reflect pad, an STFT as a 256-tap strided convolution, four small
convolutions over 4, 4, 2 and 1 frames, an LSTM cell and a 1x1 output
convolution. onnxruntime runs each of those convolutions as one small matrix
product per row, so a 500-row call spends most of its time on per-row work.
The graph built here computes the same network with every convolution
unrolled into a single matrix product over all rows and frames (the frames
and the taps are gathered first, as im2col does), so each layer is one large
GEMM and the per-row overhead goes (figures in BENCHMARKS.md).

The weights are read from the wheel's own model file, never from elsewhere,
and `tests/unit/test_vad.py` checks the result against that model. The graph
takes `input` [batch, 576] and `state` [2, batch, 128] and returns `output`
[batch, 1] and `stateN` [2, batch, 128]; unlike the original it has no `sr`
input (it is the 16 kHz branch only).
"""

from __future__ import annotations

import numpy as np

INPUT = 576  # 64 samples of context + one 512-sample window
_PREFIX = "If_0_then_branch__Inline_0__"  # the 16 kHz branch of the original graph's `If`
_WEIGHTS = (
    "stft.forward_basis_buffer",
    "encoder.0.reparam_conv.weight", "encoder.0.reparam_conv.bias",
    "encoder.1.reparam_conv.weight", "encoder.1.reparam_conv.bias",
    "encoder.2.reparam_conv.weight", "encoder.2.reparam_conv.bias",
    "encoder.3.reparam_conv.weight", "encoder.3.reparam_conv.bias",
    "decoder.rnn.weight_ih", "decoder.rnn.weight_hh", "decoder.rnn.bias_ih", "decoder.rnn.bias_hh",
    "decoder.decoder.2.weight", "decoder.decoder.2.bias",
)


def read_weights(path: str) -> dict[str, np.ndarray]:
    """The 16 kHz branch's weights from a Silero VAD ONNX file, by their PyTorch names."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    found: dict[str, np.ndarray] = {}
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name != "then_branch":
                continue
            for const in attr.g.node:
                name = const.output[0].removeprefix(_PREFIX) if const.op_type == "Constant" else ""
                if name in _WEIGHTS:
                    found[name] = numpy_helper.to_array(const.attribute[0].t).astype(np.float32)
    missing = [n for n in _WEIGHTS if n not in found]
    if missing:
        raise ValueError(f"{path} is not the Silero VAD v6 layout this graph expects: no {', '.join(missing)}")
    return found


def _taps(weight: np.ndarray, taps: list[int]) -> np.ndarray:
    """A convolution's weight [out, in, k] as a [len(taps) * in, out] matrix, tap-major,
    for input frames laid out [tap0 channels, tap1 channels, ...]."""
    return np.ascontiguousarray(weight[:, :, taps].transpose(2, 1, 0).reshape(-1, weight.shape[0]))


# The graph's integer constants: slice bounds, pads and shapes.
_INTS = {
    "i0": [0], "i1": [1], "i2": [2], "i3": [3], "i4": [4], "i5": [5], "i6": [6], "i129": [129],
    "end": [1 << 30],
    "pad_right_64": [0, 0, 0, 64],  # [B, 576] -> [B, 640]
    "pad_frames_both": [0, 1, 0, 0, 1, 0],  # [B, T, C] -> [B, T + 2, C]
    "pad_frames_front": [0, 1, 0, 0, 0, 0],  # [B, T, C] -> [B, T + 1, C]
    "chunks": [0, 5, 128],
    "flat_128": [0, 128],
}


def _weights(path: str) -> dict[str, np.ndarray]:
    """The Silero weights the batched graph uses, laid out for its GEMMs."""
    w = read_weights(path)
    return {
        "w_stft": np.ascontiguousarray(w["stft.forward_basis_buffer"][:, 0, :].T),  # [256, 258]
        "w1": _taps(w["encoder.0.reparam_conv.weight"], [0, 1, 2]), "b1": w["encoder.0.reparam_conv.bias"],
        "w2": _taps(w["encoder.1.reparam_conv.weight"], [0, 1, 2]), "b2": w["encoder.1.reparam_conv.bias"],
        # conv3 (stride 2, pad 1) over 2 frames sees [0, f0, f1]; conv4 over 1 frame sees [0, f0, 0]
        "w3": _taps(w["encoder.2.reparam_conv.weight"], [1, 2]), "b3": w["encoder.2.reparam_conv.bias"],
        "w4": _taps(w["encoder.3.reparam_conv.weight"], [1]), "b4": w["encoder.3.reparam_conv.bias"],
        "w_lstm": np.ascontiguousarray(
            np.concatenate([w["decoder.rnn.weight_ih"], w["decoder.rnn.weight_hh"]], axis=1).T
        ),  # [x, h] @ w_lstm: the four gates i, f, g, o
        "b_lstm": w["decoder.rnn.bias_ih"] + w["decoder.rnn.bias_hh"],
        "w_out": np.ascontiguousarray(w["decoder.decoder.2.weight"][0]),  # [128, 1]
        "b_out": w["decoder.decoder.2.bias"],
    }


def batched_model(path: str) -> bytes:
    """The serialized ONNX model computing Silero VAD at 16 kHz with batch-wide GEMMs."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    tensors, ints = _weights(path), _INTS
    nodes = []

    def op(kind: str, inputs: list[str], out: str, **attrs: object) -> str:
        nodes.append(helper.make_node(kind, inputs, [out], **attrs))
        return out

    def frames(x: str, start: str, stop: str, out: str, step: str | None = None) -> str:
        """x[:, start:stop:step] along the frame axis."""
        return op("Slice", [x, start, stop, "i1"] + ([step] if step else []), out)

    def dense(x: str, weight: str, bias: str, out: str) -> str:
        return op("Relu", [op("Add", [op("MatMul", [x, weight], out + "_mm"), bias], out + "_b")], out)

    # STFT: 5 chunks of 128 samples; frame f is chunks f and f + 1.
    x5 = op("Reshape", [op("Pad", ["input", "pad_right_64"], "padded", mode="reflect"), "chunks"], "x5")
    spec_frames = op("Concat", [frames(x5, "i0", "i4", "lo"), frames(x5, "i1", "i5", "hi")], "stft_in", axis=2)
    spec = op("MatMul", [spec_frames, "w_stft"], "spec")  # [B, 4, 258]: 129 real, 129 imaginary
    real = op("Slice", [spec, "i0", "i129", "i2"], "real")
    imag = op("Slice", [spec, "i129", "end", "i2"], "imag")
    power = op("Add", [op("Mul", [real, real], "real2"), op("Mul", [imag, imag], "imag2")], "power")
    mag = op("Sqrt", [power], "mag")  # [B, 4, 129]
    # conv1: kernel 3, pad 1, stride 1 over 4 frames.
    p1 = op("Pad", [mag, "pad_frames_both"], "p1")
    taps1 = [frames(p1, "i0", "i4", "t1a"), frames(p1, "i1", "i5", "t1b"), frames(p1, "i2", "i6", "t1c")]
    h1 = dense(op("Concat", taps1, "c1", axis=2), "w1", "b1", "h1")  # [B, 4, 128]
    # conv2: kernel 3, pad 1, stride 2 over 4 frames -> 2 frames (taps 2t - 1, 2t, 2t + 1).
    p2 = op("Pad", [h1, "pad_frames_front"], "p2")
    taps2 = [frames(p2, "i0", "i3", "t2a", "i2"), frames(p2, "i1", "i4", "t2b", "i2"),
             frames(p2, "i2", "i5", "t2c", "i2")]
    h2 = dense(op("Concat", taps2, "c2", axis=2), "w2", "b2", "h2")  # [B, 2, 64]
    h3 = dense(op("Reshape", [h2, "flat_128"], "h2_flat"), "w3", "b3", "h3")  # [B, 64]
    h4 = dense(h3, "w4", "b4", "h4")  # [B, 128]
    # LSTM cell, state [2, B, 128] = (h, c).
    h_prev = op("Squeeze", [op("Slice", ["state", "i0", "i1", "i0"], "h_slice"), "i0"], "h_prev")
    c_prev = op("Squeeze", [op("Slice", ["state", "i1", "i2", "i0"], "c_slice"), "i0"], "c_prev")
    xh = op("Concat", [h4, h_prev], "xh", axis=1)
    gates = op("Add", [op("MatMul", [xh, "w_lstm"], "gates_mm"), "b_lstm"], "gates")
    nodes.append(helper.make_node("Split", [gates], ["g_i", "g_f", "g_g", "g_o"], axis=1, num_outputs=4))
    keep = op("Mul", [op("Sigmoid", ["g_f"], "s_f"), c_prev], "keep")
    write = op("Mul", [op("Sigmoid", ["g_i"], "s_i"), op("Tanh", ["g_g"], "t_g")], "write")
    c_next = op("Add", [keep, write], "c_next")
    h_next = op("Mul", [op("Sigmoid", ["g_o"], "s_o"), op("Tanh", [c_next], "t_c")], "h_next")
    op("Concat", [op("Unsqueeze", [h_next, "i0"], "h_row"), op("Unsqueeze", [c_next, "i0"], "c_row")],
       "stateN", axis=0)
    logit = op("Add", [op("MatMul", [op("Relu", [h_next], "h_relu"), "w_out"], "out_mm"), "b_out"], "logit")
    op("Sigmoid", [logit], "output")

    initializers = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in tensors.items()]
    initializers += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    graph = helper.make_graph(
        nodes, "silero_vad_16k_batched",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", INPUT]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "batch", 128])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "batch", 128])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()
