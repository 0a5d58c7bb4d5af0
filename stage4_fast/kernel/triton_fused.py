"""Fused element-wise kernels for 16-bit GPU forwards (``kernel.fused_kernels_for``): residual add + RMSNorm,
q/k RMSNorm + RoPE (+ KV store), SiLU-and-mul, each one launch where PyTorch launches 4 to 10. The last two also
take a layer's deferred RMSNorm (``row_scale``, models/decoder.py). They round where PyTorch rounds (HF's op
order), so they give the unfused bf16/fp16 bits; only the fp32 reduction order inside the norm differs."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_wait
from .ref import is_fp8

# A row scale's hidden rows are read before the PDL wait: their writer finished before the cuBLAS GEMM before us.


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Out, stride_x, stride_r, stride_o, N, eps,
                        HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # one rounding, as torch's 16-bit add
        tl.store(R + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) (residual None), or residual += x in place and rms_norm(residual). x, residual: [T, N]."""
    assert x.dim() == 2 and x.stride(-1) == 1
    T, N = x.shape
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1)
    r = residual if residual is not None else x
    block = triton.next_power_of_2(N)
    pdl, pdl_options = pdl_launch(x.device)
    _add_rmsnorm_kernel[(T,)](x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), N, eps,
                              HAS_RESIDUAL=residual is not None, PDL=pdl, BLOCK=block,
                              num_warps=4 if block >= 1024 else 2, **pdl_options)
    return out


@triton.jit
def _qk_norm_rope_kernel(QKV, QW, KW, CosSin, Pos, QOut, KOut, KCache, VCache, OutLoc, Hid, stride_t, stride_cs,
                         stride_qo_t, stride_qo_h, stride_ko_t, stride_ko_h, stride_cache_t, stride_hid, hidden, eps,
                         hid_eps, k_scale, v_scale, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr,
                         SCALED: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
                         ROW_SCALE: tl.constexpr, BLOCK_HID: tl.constexpr, PDL: tl.constexpr):
    """One program per token, q and k heads as a [BLOCK_H, D / 2] tile per half. STORE_KV: rotated k and v go to
    slot ``OutLoc[t]`` (fp8 if FP8_MAX > 0). ROW_SCALE: q, k, v scaled by row ``Hid[t]``'s norm factor (v in QKV)."""
    t = tl.program_id(0).to(tl.int64)
    if ROW_SCALE:  # before the wait (the note above the kernels)
        row_scale = _rms_factor(Hid + t * stride_hid, hidden, hid_eps, BLOCK_HID)
    pdl_wait(PDL)
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, HALF)
    h = tl.arange(0, BLOCK_H)
    h_mask = h < HQ + HKV
    is_q = h < HQ
    src = QKV + t * stride_t + h[:, None] * D + offs[None, :]
    mask = h_mask[:, None]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    if ROW_SCALE:
        x1 = (x1.to(tl.float32) * row_scale).to(dtype)
        x2 = (x2.to(tl.float32) * row_scale).to(dtype)
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / D
        inv = tl.rsqrt(var + eps)[:, None]
        y1, y2 = (f1 * inv).to(dtype), (f2 * inv).to(dtype)
        w1 = tl.where(is_q[:, None], tl.load(QW + offs)[None, :], tl.load(KW + offs)[None, :]).to(tl.float32)
        w2 = tl.where(is_q[:, None], tl.load(QW + HALF + offs)[None, :],
                      tl.load(KW + HALF + offs)[None, :]).to(tl.float32)
        x1 = (w1 * y1.to(tl.float32)).to(dtype)
        x2 = (w2 * y2.to(tl.float32)).to(dtype)
    pos = tl.load(Pos + t).to(tl.int64)
    cos = tl.load(CosSin + pos * stride_cs + offs).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(CosSin + pos * stride_cs + HALF + offs).to(dtype).to(tl.float32)[None, :]
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # out = x * (cos | cos) + rotate_half(x) * (sin | sin), rotate_half(x) = (-x2 | x1); each product rounded
    o1 = ((a1 * cos).to(dtype).to(tl.float32) - (a2 * sin).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)).to(dtype)
    q_dst = QOut + t * stride_qo_t + h[:, None] * stride_qo_h + offs[None, :]
    k_dst = KOut + t * stride_ko_t + (h[:, None] - HQ) * stride_ko_h + offs[None, :]
    q_mask = is_q[:, None]
    k_mask = (h_mask & ~is_q)[:, None]
    tl.store(q_dst, o1, mask=q_mask)
    tl.store(q_dst + HALF, o2, mask=q_mask)
    tl.store(k_dst, o1, mask=k_mask)
    tl.store(k_dst + HALF, o2, mask=k_mask)
    if STORE_KV or ROW_SCALE:
        hv = tl.arange(0, BLOCK_HKV)
        v_offs = hv[:, None] * D + tl.arange(0, D)[None, :]
        v_mask = (hv < HKV)[:, None]
        v_src = QKV + t * stride_t + (HQ + HKV) * D + v_offs
        v = tl.load(v_src, mask=v_mask, other=0.0)
        if ROW_SCALE:
            v = (v.to(tl.float32) * row_scale).to(dtype)
            tl.store(v_src, v, mask=v_mask)
        if STORE_KV:  # this step's K/V into the pool here, instead of a store kernel of their own (one launch less)
            slot = tl.load(OutLoc + t).to(tl.int64)
            kc_dst = KCache + slot * stride_cache_t + (h[:, None] - HQ) * D + offs[None, :]
            cache_dtype = KCache.dtype.element_ty
            tl.store(kc_dst, _to_pool(o1, k_scale, SCALED, FP8_MAX, FP8_MANT, FP8_MIN_EXP, cache_dtype), mask=k_mask)
            tl.store(kc_dst + HALF, _to_pool(o2, k_scale, SCALED, FP8_MAX, FP8_MANT, FP8_MIN_EXP, cache_dtype),
                     mask=k_mask)
            tl.store(VCache + slot * stride_cache_t + v_offs,
                     _to_pool(v, v_scale, SCALED, FP8_MAX, FP8_MANT, FP8_MIN_EXP, cache_dtype), mask=v_mask)


@triton.jit
def _rms_factor(row, n, eps, BLOCK: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of the n values at ``row``, in fp32."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(row + offs, mask=offs < n, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)


@triton.jit
def _to_pool(x, scale, SCALED: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr,
             FP8_MIN_EXP: tl.constexpr, cache_dtype: tl.constexpr):
    """A K or V tile as the pool stores it: fp8 gets x / scale (correctly rounded), saturated, rounded to nearest
    even, bit for bit as kernel/ref.py's quantize_kv; a 16-bit pool gets x."""
    out = x
    if FP8_MAX > 0:  # (one return: the compiler wants one return type, and a constexpr branch keeps the other)
        y = x.to(tl.float32)
        if SCALED == 1:  # a correctly rounded division is a few dozen instructions: only where a scale is not 1
            y = tl.math.div_rn(y, scale)
        elif SCALED == 2:  # power-of-two scales come inverted: times 2^-n is the quotient, exactly
            y = y * scale
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        out = _round_to_fp8_grid(y, FP8_MANT, FP8_MIN_EXP).to(cache_dtype)
    return out


@triton.jit
def _round_to_fp8_grid(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 rounded to an fp8 grid (MANT mantissa bits, min exponent MIN_EXP), nearest even, so the cast is exact (the
    interpreter rounds ties up, no carry): adding and subtracting 1.5 * 2^(23 + e) rounds |y| to a multiple of 2^e."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)  # the binade (subnormals share the smallest normal's)
    magic = (((exp - MANT + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


def qk_norm_rope(qkv: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                 kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 kv_scales: tuple[float, float] = (1.0, 1.0),
                 row_scale: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k [T, Hkv, D], per-head RMS-normed (given weights) and rotated
    (neox) by the fp32 cos|sin table. ``kv_store`` = (k_cache, v_cache, out_loc [T]) also stores k and v (fp8: /
    ``kv_scales``). ``row_scale`` = (hidden [T, N], eps): the deferred norm's factor scales q, k, v first."""
    assert qkv.dim() == 2 and qkv.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert head_dim % 2 == 0 and (head_dim & (head_dim - 1)) == 0, "head_dim must be a power of two"
    T = qkv.shape[0]
    q = torch.empty(T, num_qo_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q, k
    has_norm = q_weight is not None and k_weight is not None
    qw, kw = (q_weight, k_weight) if has_norm else (cos_sin_cache, cos_sin_cache)  # unused without a norm
    block_h = triton.next_power_of_2(num_qo_heads + num_kv_heads)
    if kv_store is not None:
        k_cache, v_cache, out_loc = kv_store
        assert k_cache.dtype == qkv.dtype or is_fp8(k_cache.dtype), k_cache.dtype
        assert k_cache.shape[1:] == (num_kv_heads, head_dim)
        assert k_cache.stride() == v_cache.stride() and k_cache.stride()[1:] == (head_dim, 1)
        cache_stride = k_cache.stride(0)
        fp8_max = fp8_mant = fp8_min_exp = 0
        if is_fp8(k_cache.dtype):  # the format's largest value, mantissa bits and smallest normal exponent
            info = torch.finfo(k_cache.dtype)  # (e4m3: 448, 3, -6; e5m2: 57344, 2, -14)
            fp8_max, fp8_mant, fp8_min_exp = info.max, -int(math.log2(info.eps)), int(math.log2(info.smallest_normal))
    else:
        k_cache = v_cache = out_loc = q  # unused
        cache_stride, fp8_max, fp8_mant, fp8_min_exp = 0, 0.0, 0, 0
    hidden, hidden_eps = row_scale if row_scale is not None else (q, 0.0)  # q: unused
    kv_scales = tuple(map(float, kv_scales))
    scaled = 0 if kv_scales == (1.0, 1.0) else 2 if all(math.frexp(s)[0] == 0.5 for s in kv_scales) else 1
    assert row_scale is None or (hidden.dim() == 2 and hidden.shape[0] == T and hidden.stride(-1) == 1)
    pdl, pdl_options = pdl_launch(qkv.device)
    _qk_norm_rope_kernel[(T,)](
        qkv, qw, kw, cos_sin_cache, positions, q, k, k_cache, v_cache, out_loc, hidden, qkv.stride(0),
        cos_sin_cache.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache_stride, hidden.stride(0),
        hidden.shape[-1], eps, hidden_eps, *(1 / s if scaled == 2 else s for s in kv_scales), HQ=num_qo_heads,
        HKV=num_kv_heads, D=head_dim, BLOCK_H=block_h, BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        HAS_NORM=has_norm, STORE_KV=kv_store is not None, SCALED=scaled, FP8_MAX=fp8_max, FP8_MANT=fp8_mant,
        FP8_MIN_EXP=fp8_min_exp, ROW_SCALE=row_scale is not None, BLOCK_HID=triton.next_power_of_2(hidden.shape[-1]),
        PDL=pdl, num_warps=4 if block_h * head_dim >= 2048 else 2, **pdl_options,
    )
    return q, k


@triton.jit
def _silu_and_mul_kernel(X, Out, Hid, stride_x, stride_o, stride_hid, N, hidden, hid_eps, ROW_SCALE: tl.constexpr,
                         BLOCK_HID: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    # the deferred norm, before the wait (the note above the kernels)
    if ROW_SCALE:
        row_scale = _rms_factor(Hid + t * stride_hid, hidden, hid_eps, BLOCK_HID)
    pdl_wait(PDL)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(X + t * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(X + t * stride_x + N + offs, mask=mask, other=0.0)
    if ROW_SCALE:
        g, u = (g.to(tl.float32) * row_scale).to(g.dtype), (u.to(tl.float32) * row_scale).to(u.dtype)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(Out + t * stride_o + offs, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [T, 2N] = [gate | up] -> silu(gate) * up [T, N]; ``row_scale`` as in qk_norm_rope."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    T, N = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    hidden, hidden_eps = row_scale if row_scale is not None else (x, 0.0)  # x: unused
    assert row_scale is None or (hidden.dim() == 2 and hidden.shape[0] == T and hidden.stride(-1) == 1)
    block = min(1024, triton.next_power_of_2(N))
    pdl, pdl_options = pdl_launch(x.device)
    _silu_and_mul_kernel[(T, triton.cdiv(N, block))](
        x, out, hidden, x.stride(0), out.stride(0), hidden.stride(0), N, hidden.shape[-1], hidden_eps,
        ROW_SCALE=row_scale is not None, BLOCK_HID=triton.next_power_of_2(hidden.shape[-1]), PDL=pdl, BLOCK=block,
        num_warps=4, **pdl_options)
    return out
