"""Fused RMSNorm(+SiLU) over the channel axis, the Wan VAE decoder's norm epilogue.

The reference is diffusers' `WanRMS_norm` followed by the block's SiLU:
`F.normalize(x, dim=1) * scale * gamma + bias`, then `x * sigmoid(x)`, where
`F.normalize` divides by max(‖x‖₂, 1e-12) over the channels (in float32 for
half-precision inputs). The kernel reads x once and writes the result once
(the reference makes four passes: norm, divide, affine, SiLU).

Contract: x is [B, C, H, W] or [B, C, T, H, W] with dense H x W planes (any
batch/channel/time strides: the decoder's temporal upsampling leaves x
time-major), float32/float16/bfloat16, C ≤ 4096,
gamma has C elements, bias is 0 or C elements, on CUDA (or the CPU under the
Triton interpreter).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.nn.functional as F

from .dispatch import FLOAT_DTYPES, MAX_ELEMENTS, Dispatcher, device_refused

EPS = 1e-12
MAX_CHANNELS = 4096


def rms_norm_reference(x: torch.Tensor, gamma: torch.Tensor, bias: Any, scale: float, silu: bool) -> torch.Tensor:
    """diffusers' WanRMS_norm (channel-first), then SiLU when `silu`."""
    half = x.dtype in (torch.float16, torch.bfloat16)
    y = F.normalize(x.float() if half else x, dim=1).to(x.dtype) * scale * gamma + bias
    return F.silu(y) if silu else y


def _contract(x: torch.Tensor, gamma: torch.Tensor, bias: Any, scale: float, silu: bool
              ) -> tuple[Hashable, str | None]:
    key = (tuple(x.shape), x.dtype, str(x.device), silu)
    if x.dim() not in (4, 5):
        return key, f"needs [B, C, H, W] or [B, C, T, H, W], got {x.dim()} dims"
    if x.dtype not in FLOAT_DTYPES:
        return key, f"dtype {x.dtype}"
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        return key, "H x W planes are not dense"
    if x.shape[1] > MAX_CHANNELS:
        return key, f"{x.shape[1]} channels > {MAX_CHANNELS}"
    if x.numel() > MAX_ELEMENTS:
        return key, "too many elements for int32 indexing"
    if gamma.numel() != x.shape[1] or (isinstance(bias, torch.Tensor) and bias.numel() != x.shape[1]):
        return key, "gamma/bias do not have one value per channel"
    if isinstance(bias, torch.Tensor):
        return key, device_refused(x, gamma, bias)
    if bias != 0:
        return key, "a scalar bias other than 0"
    return key, device_refused(x, gamma)


def _launch(x: torch.Tensor, gamma: torch.Tensor, bias: Any, scale: float, silu: bool) -> torch.Tensor:
    import triton

    from ._triton import rms_norm_kernel

    b, c = x.shape[:2]
    hw = x.shape[-1] * x.shape[-2]
    s = x.numel() // (b * c)
    stride_t = x.stride(2) if x.dim() == 5 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_c = triton.next_power_of_2(c)
    block_s = max(16, min(128, 16384 // block_c))
    has_bias = isinstance(bias, torch.Tensor)
    rms_norm_kernel[(triton.cdiv(s, block_s), b)](
        x, out, gamma.reshape(-1).contiguous(), bias.reshape(-1).contiguous() if has_bias else gamma,
        c, s, hw, x.stride(0), x.stride(1), stride_t, EPS, float(scale), HAS_BIAS=has_bias, SILU=silu, BLOCK_C=block_c, BLOCK_S=block_s,
        num_warps=8 if block_c * block_s >= 8192 else 4)
    return out


rms_norm = Dispatcher("rms_norm_silu", _launch, rms_norm_reference, _contract)
