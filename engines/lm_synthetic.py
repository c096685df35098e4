"""Synthetic LMs: Llama-family models of a named shape with random weights, for capacity runs.

The cost of a decode step depends on the shape (layers, widths, heads, vocab),
not on the weights, so capacity planning for a model that is not on the
machine can run on one of its shape. The outputs are meaningless and every
caller says so (`describe()` in logs and reports).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

# Published shapes: 0.5b ~ Qwen2.5-0.5B, 1b ~ Llama-3.2-1B, 7b ~ Mistral-7B / the 7B duplex speech models.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32768),
}


def describe(size: str) -> str:
    shape = SHAPES[size]
    return (f"synthetic {size} LM (random weights, outputs meaningless): {shape['num_hidden_layers']} layers, "
            f"hidden {shape['hidden_size']}, {shape['num_attention_heads']}/{shape['num_key_value_heads']} "
            f"heads, vocab {shape['vocab_size']}")


def synthetic_llama(size: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    context: int = 4096, seed: int = 0) -> Any:
    """A `LlamaForCausalLM` of the named shape with seeded random weights, built on `device`."""
    if size not in SHAPES:
        raise ValueError(f"unknown synthetic LM size {size!r}; one of {', '.join(SHAPES)}")
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = size in ("0.5b", "1b")  # as the published models of those shapes
    config = LlamaConfig(**SHAPES[size], max_position_embeddings=context, tie_word_embeddings=tied)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    log.warning("LM: %s", describe(size))
    return model.eval().requires_grad_(False)


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
