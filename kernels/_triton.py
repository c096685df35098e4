"""The Triton kernels themselves (imported on first launch: `TRITON_INTERPRET` is read then).

See rmsnorm.py and causal_conv.py for what each computes and its contract.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, out_ptr, gamma_ptr, bias_ptr, C, S, HW, stride_b, stride_c, stride_t, eps, scale,
                    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: all C channels of BLOCK_S positions of one batch item. x is [B, C, T, H*W] with
    any B/C/T strides and dense H*W planes; out is contiguous [B, C, S = T*H*W]."""
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    c = tl.arange(0, BLOCK_C)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    c_ok = c < C
    mask = c_ok[:, None] & (s[None, :] < S)
    src = b * stride_b + c[:, None] * stride_c + (s // HW * stride_t + s % HW)[None, :]
    offs = b * C * S + c[:, None] * S + s[None, :]
    x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
    norm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=0)), eps)
    gamma = tl.load(gamma_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    y = (x / norm[None, :]) * scale * gamma[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def assemble_kernel(x_ptr, cache_ptr, out_ptr, total, C, TC, H, W, TO, HO, WO, PT, PH, PW,
                    xs_b, xs_c, xs_t, xs_h, xs_w, cs_b, cs_c, cs_t, cs_h, cs_w, BLOCK: tl.constexpr):
    """out[b, c, to, ho, wo] = cat(cache, x)[b, c, to - PT, ho - PH, wo - PW], 0 outside; out is
    contiguous, x and cache are read through their strides."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    wo = offs % WO
    rest = offs // WO
    ho = rest % HO
    rest = rest // HO
    to = rest % TO
    rest = rest // TO
    c = rest % C
    b = rest // C
    h = ho - PH
    w = wo - PW
    t = to - PT
    inside = live & (h >= 0) & (h < H) & (w >= 0) & (w < W) & (t >= 0)
    from_cache = inside & (t < TC)
    from_x = inside & (t >= TC)
    cached = tl.load(cache_ptr + b * cs_b + c * cs_c + t * cs_t + h * cs_h + w * cs_w, mask=from_cache, other=0.0)
    fresh = tl.load(x_ptr + b * xs_b + c * xs_c + (t - TC) * xs_t + h * xs_h + w * xs_w, mask=from_x, other=0.0)
    tl.store(out_ptr + offs, tl.where(from_cache, cached, fresh), mask=live)
