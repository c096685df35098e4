"""Causal-conv input assembly of the Wan VAE decoder: cached frames + new frames + zero padding.

Before each causal 3D convolution, diffusers' `WanCausalConv3d` concatenates
the frames cached from the previous step in front of the new ones
(`torch.cat`, one copy) and zero-pads time (front only), height and width
(`F.pad`, a second copy). The kernel writes the padded input in one pass,
reading each source element once. Pure data movement: the result is
bit-identical to the reference.

`padding` is the conv's `_padding`: (w_left, w_right, h_top, h_bottom,
t_front, t_back); the cache is used only when t_front > 0, as in diffusers.
Contract: x [B, C, T, H, W] (any strides: the decoder's temporal upsampling
leaves it time-major); cache None or [B, C, Tc, H, W] with the same dtype and
device and Tc ≤ t_front; t_back 0; on CUDA (or the CPU under the Triton
interpreter). The output is contiguous.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F

from .dispatch import MAX_ELEMENTS, Dispatcher, device_refused

BLOCK = 1024


def assemble_reference(x: torch.Tensor, cache: torch.Tensor | None, padding: Sequence[int]) -> torch.Tensor:
    """What `WanCausalConv3d.forward` feeds its convolution."""
    pad = list(padding)
    if cache is not None and pad[4] > 0:
        x = torch.cat([cache.to(x.device), x], dim=2)
        pad[4] -= cache.shape[2]
    return F.pad(x, pad)


def _used_cache(cache: torch.Tensor | None, padding: Sequence[int]) -> torch.Tensor | None:
    return cache if cache is not None and padding[4] > 0 else None


def _contract(x: torch.Tensor, cache: torch.Tensor | None, padding: Sequence[int]) -> tuple[Hashable, str | None]:
    cache = _used_cache(cache, padding)
    key = (tuple(x.shape), None if cache is None else tuple(cache.shape), x.dtype, str(x.device), tuple(padding))
    if x.dim() != 5 or len(padding) != 6:
        return key, "needs a 5D input and 6 padding values"
    if padding[5] != 0 or min(padding) < 0:
        return key, f"padding {tuple(padding)} is not causal"
    if cache is not None:
        same = cache.shape[:2] == x.shape[:2] and cache.shape[3:] == x.shape[3:]
        if not same or cache.dtype != x.dtype:
            return key, "cache does not match x (shape or dtype)"
        if cache.shape[2] > padding[4]:
            return key, "more cached frames than the causal padding"
    b, c, t, h, w = x.shape
    out = b * c * (t + padding[4]) * (h + padding[2] + padding[3]) * (w + padding[0] + padding[1])
    if max(out, x.numel() + x.storage_offset(), 0 if cache is None else cache.numel()) > MAX_ELEMENTS:
        return key, "too many elements for int32 indexing"
    return key, device_refused(x) if cache is None else device_refused(x, cache)


def _launch(x: torch.Tensor, cache: torch.Tensor | None, padding: Sequence[int]) -> torch.Tensor:
    import triton

    from ._triton import assemble_kernel

    cache = _used_cache(cache, padding)
    b, c, t, h, w = x.shape
    pw0, pw1, ph0, ph1, pt, _ = padding
    tc = 0 if cache is None else cache.shape[2]
    out = torch.empty((b, c, t + pt, h + ph0 + ph1, w + pw0 + pw1), dtype=x.dtype, device=x.device)
    total = out.numel()
    src = x if cache is None else cache
    assemble_kernel[(triton.cdiv(total, BLOCK),)](
        x, src, out, total, c, tc, h, w, out.shape[2], out.shape[3], out.shape[4], pt - tc, ph0, pw0,
        *x.stride(), *src.stride(), BLOCK=BLOCK)
    return out


assemble = Dispatcher("causal_conv_assemble", _launch, assemble_reference, _contract)
