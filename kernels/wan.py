"""The Wan VAE decoder fast path: levels `off` (diffusers as it is) and `fused`.

`install(vae, "fused")` changes the decoder in place:
- each residual block's `norm1`/`norm2` (and the head's `norm_out`) followed
  by its SiLU becomes one `FusedRMSNorm` (kernels/rmsnorm.py), and the now
  redundant SiLU module becomes `nn.Identity`; other `WanRMS_norm`s (the
  attention block's) become `FusedRMSNorm` without SiLU;
- each causal conv with temporal padding assembles its input (cache + frames
  + zero padding) with kernels/causal_conv.py and convolves with padding 0.
`install(vae, "off")` puts every original module and method back. Outside a
kernel's contract (e.g. on a CPU without the interpreter) each part runs its
reference twin, which is what diffusers computes.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from .causal_conv import assemble
from .rmsnorm import rms_norm

LEVELS = ("off", "fused")
_STATE = "_rtmedia_fast_path"


class FusedRMSNorm(nn.Module):
    """A `WanRMS_norm` (channel-first), optionally with the SiLU after it, through the kernel dispatcher."""

    def __init__(self, norm: nn.Module, silu: bool) -> None:
        super().__init__()
        self.norm, self.silu = norm, silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm
        return rms_norm(x, n.gamma, n.bias, n.scale, self.silu)


def _conv_forward(self: nn.Conv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    return nn.Conv3d.forward(self, assemble(x, cache_x, self._padding))


def level(vae: Any) -> str:
    return "fused" if getattr(_decoder(vae), _STATE, None) else "off"


def _decoder(vae: Any) -> nn.Module:
    return getattr(vae, "decoder", vae)


def install(vae: Any, fast_path: str) -> int:
    """Set the decoder's fast-path level; returns how many modules the fused level changed."""
    if fast_path not in LEVELS:
        raise ValueError(f"fast path must be one of {', '.join(LEVELS)}, got {fast_path!r}")
    decoder = _decoder(vae)
    changes: list[tuple[Any, str, Any]] | None = getattr(decoder, _STATE, None)
    if fast_path == "off":
        for owner, name, original in reversed(changes or []):
            if original is None:
                delattr(owner, name)  # an instance attribute we added
            else:
                setattr(owner, name, original)
        if changes is not None:
            delattr(decoder, _STATE)
        return 0
    if changes is not None:
        return len(changes)
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanRMS_norm

    changes = []
    fused: set[int] = set()
    for module in decoder.modules():
        act = getattr(module, "nonlinearity", None)
        pairs = [n for n in ("norm1", "norm2", "norm_out") if isinstance(getattr(module, n, None), WanRMS_norm)]
        if pairs and isinstance(act, nn.SiLU):
            for name in pairs:
                norm = getattr(module, name)
                if norm.channel_first:
                    changes.append((module, name, norm))
                    fused.add(id(norm))
            if all(id(getattr(module, n)) in fused for n in pairs):
                changes.append((module, "nonlinearity", act))
    for module in list(decoder.modules()):
        for name, child in module.named_children():
            if isinstance(child, WanRMS_norm) and child.channel_first and id(child) not in fused:
                changes.append((module, name, child))
        if isinstance(module, WanCausalConv3d) and module._padding[4] > 0:
            changes.append((module, "forward", None))
    for owner, name, original in changes:
        if name == "forward":
            owner.forward = types.MethodType(_conv_forward, owner)
        elif name == "nonlinearity":
            setattr(owner, name, nn.Identity())
        else:
            setattr(owner, name, FusedRMSNorm(original, silu=id(original) in fused))
    setattr(decoder, _STATE, changes)
    return len(changes)
