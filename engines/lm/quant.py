"""Int8 linear layers for the LM engine on the CPU (`lm_quantize="int8"`).

Weights are quantized once per output channel (symmetric, scale = max|w|/127);
activations are quantized per row (per token) at every call, the product is
an exact int32 matrix multiply (`torch._int_mm`), and the result is rescaled
by row scale times channel scale. Every step is row-wise, so a row's result
does not depend on the other rows of its batch (with the compact forward's
per-row attention spans, batched decode is bit-identical to one-by-one; see
engines/lm/engine.py). PyTorch's dynamic quantization shares one activation scale
across the whole batch, so there a row's result depends on its batch-mates; it
is not used.

Speed against float32 (prefill, decode at 1/4/16 sessions) is measured by
tests/perf/bench_lm.py; see BENCHMARKS.md.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """A drop-in `nn.Linear` replacement with int8 weights and per-row int8 activations."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", q.t(), persistent=False)  # [in, out] view, as _int_mm takes it
        self.register_buffer("scale", scale, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        q = torch.round(rows / row_scale).clamp_(-127, 127).to(torch.int8)
        out = torch._int_mm(q, self.weight_t).float().mul_(row_scale).mul_(self.scale)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)


def quantize_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by an `Int8Linear`; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
                count += 1
    return count
