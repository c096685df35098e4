"""A compact forward pass for Llama-family models (Llama, Mistral, Qwen2) on the slot cache.

transformers' generic forward spends most of a small model's decode step in
Python: 30 layers times a few dozen small ops, three separate q/k/v matmuls and
two MLP input matmuls per layer, a `Cache` object consulted per layer. For the
135M embedded model that overhead is a large share of a float32 step on one core
(BENCHMARKS.md). This
module runs the same arithmetic with the model's own weights:

- q, k, v projections fused into one matrix, gate and up into another;
- RoPE cos/sin for every position of the context computed once, by the
  model's own rotary module (so RoPE scaling variants with fixed frequencies
  are honoured), and gathered per row;
- K/V written straight into the engine's cache tensors (the layout of
  engines/lm/engine.py: [slots + 1, kv_heads, context, head_dim] per layer) and
  attended with `scaled_dot_product_attention` (grouped-query heads natively)
  under the same per-row additive mask.

Linear layers are either float (`F.linear` on the fused weights) or, with
`quantize="int8"`, `Int8Linear` (engines/lm/quant.py). Logits agree with the
transformers forward within float rounding (tests compare both on tiny
models). Anything outside the family (other activations, q/k norms,
position-dependent RoPE like `dynamic`, sliding windows) is reported by
`unsupported()`, and the engine then uses the transformers forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from rtmedia.engines.lm.quant import Int8Linear
from torch import nn

FAMILY = ("llama", "mistral", "qwen2")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def unsupported(model: Any) -> str | None:
    """Why the compact forward cannot run `model`, or None when it can."""
    cfg = model.config
    if cfg.model_type not in FAMILY:
        return f"model type {cfg.model_type!r} is not one of {', '.join(FAMILY)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} is not silu"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"RoPE type {rope!r} depends on the sequence length"
    attn = model.model.layers[0].self_attn
    if any(hasattr(attn, name) for name in ("q_norm", "k_norm")):
        return "q/k normalisation is not part of the compact forward"
    return None


def _linear(weights: list[torch.Tensor], biases: list[torch.Tensor | None], quantize: str | None) -> nn.Module:
    weight = torch.cat(weights)
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype) for w, b in zip(weights, biases, strict=True)])
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                      dtype=weight.dtype)
    layer.weight.data = weight
    if bias is not None:
        layer.bias.data = bias
    return Int8Linear(layer) if quantize == "int8" else layer


class _Layer(nn.Module):
    def __init__(self, layer: Any, quantize: str | None) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.qkv = _linear([p.weight for p in projections], [p.bias for p in projections], quantize)
        self.o = _linear([attn.o_proj.weight], [attn.o_proj.bias], quantize)
        self.gate_up = _linear([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias],
                               quantize)
        self.down = _linear([mlp.down_proj.weight], [mlp.down_proj.bias], quantize)


class CompactLlama:
    """The forward of one Llama-family model over an engine's K/V tensors (see the module docstring)."""

    def __init__(self, model: Any, context: int, quantize: str | None = None) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.embed = model.model.embed_tokens.weight
        self.norm = model.model.norm.weight
        head = model.lm_head
        self.lm_head = _linear([head.weight], [head.bias], quantize)
        self.layers = [_Layer(layer, quantize) for layer in model.model.layers]
        positions = torch.arange(context, device=self.embed.device)[None]
        cos, sin = model.model.rotary_emb(self.embed[:1], positions)
        self.cos, self.sin = cos[0], sin[0]  # [context, head_dim]

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                groups: list[tuple[torch.Tensor, int]] | None) -> torch.Tensor:
        gqa = self.kv_heads != self.heads
        if groups is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        if len(groups) == 1:
            n = groups[0][1]
            return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], attn_mask=mask[..., :n],
                                                  enable_gqa=gqa)
        out = torch.empty_like(q)
        for rows, n in groups:
            out[rows] = F.scaled_dot_product_attention(q[rows], k[rows, :, :n], v[rows, :, :n],
                                                       attn_mask=mask[rows, ..., :n], enable_gqa=gqa)
        return out

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]], write: Any,
                groups: list[tuple[torch.Tensor, int]] | None = None) -> torch.Tensor:
        """Logits [B, vocab] of each row's last position.

        tokens, positions: [B, q]; mask: additive [B, 1, q, L]; cache: (keys, values) per layer;
        `write(keys, values, k, v)` stores the new k, v [B, kv_heads, q, head_dim] and returns the
        K, V [B, kv_heads, L, head_dim] to attend over. `groups` (rows, n): those rows attend over
        positions [0, n) only, so that a row's attention sums exactly the same terms in the same
        order whatever the lengths of its batch-mates (see engines/lm/engine.py)."""
        b, q = tokens.shape
        heads, kv, hd = self.heads, self.kv_heads, self.head_dim
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, q, hd]
        x = self.embed[tokens]
        for layer, (keys, values) in zip(self.layers, cache, strict=True):
            qkv = layer.qkv(self._rms(x, layer.ln1)).view(b, q, heads + 2 * kv, hd).transpose(1, 2)
            qk = self._rope(qkv[:, : heads + kv], cos, sin)
            k_all, v_all = write(keys, values, qk[:, heads:], qkv[:, heads + kv :])
            attn = self._attend(qk[:, :heads], k_all, v_all, mask, groups)
            x = x + layer.o(attn.transpose(1, 2).reshape(b, q, heads * hd))
            gate, up = layer.gate_up(self._rms(x, layer.ln2)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return self.lm_head(self._rms(x[:, -1], self.norm)).float()
