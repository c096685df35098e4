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
from rtmedia.engines.lm.engine import LmEngine

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


class SyntheticLmEngine(LmEngine):
    """An `LmEngine` on `synthetic_llama(size)`, built at `load()` on `device` in `dtype`, with the
    self-contained character-level chat tokenizer (engines/lm/models.py) so that a server can run
    its `llm` lane on it for capacity runs. Every forward costs what the model of that shape costs;
    the returned logits are cut to the tokenizer's text tokens (special tokens, end of sequence
    included, never win), so a reply is gibberish that runs to its token limit, as a capacity
    run wants."""

    def __init__(self, size: str, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, **kwargs: Any) -> None:
        if size not in SHAPES:
            raise ValueError(f"unknown synthetic LM size {size!r}; one of {', '.join(SHAPES)}")
        super().__init__(f"<{describe(size)}>", dtype=dtype, device=device, **kwargs)
        self.size = size
        self._special: torch.Tensor | None = None  # the tokenizer's special ids, never chosen

    def load(self) -> None:
        if self._cache is None:
            from rtmedia.engines.lm.models import tiny_tokenizer

            assert self.device is not None
            self._given = synthetic_llama(self.size, self.dtype, self.device, context=self.context)
            self.tokenizer = tiny_tokenizer()
            self._special = torch.tensor(sorted(set(self.tokenizer.all_special_ids)), device=self.device)
        super().load()

    def close(self) -> None:
        super().close()
        self._given = self._special = None  # a later load() builds it again

    def _forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Every forward (prefill, eager and graph-captured decode): logits [B, tokenizer size] with the
        special tokens at -inf."""
        assert self._special is not None
        return super()._forward(*args, **kwargs)[:, :len(self.tokenizer)].index_fill(-1, self._special, -torch.inf)
