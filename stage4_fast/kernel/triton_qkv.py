"""A decode batch's qkv projection with the q/k norm, RoPE and this step's K/V store in its epilogue: one kernel
where the deferred-norm layer (models/decoder.py) launches a cuBLAS GEMM and the q/k norm + RoPE kernel
(``triton_fused.qk_norm_rope``).

Why: a decode step's fixed cost is its ~200 kernels, not their bytes (bench/gpu_notes.md sections 13-29); the q/k
kernel re-reads the GEMM's output only to normalise, rotate and store it. Here each program owns one head (D output
columns, as two halves of D / 2 for RoPE's neox pairs) of BLOCK_M rows, so the head's whole output is in its
registers when the K loop ends: it multiplies the rows by the deferred input norm's factor (the sum of squares of
the rows it streamed for the product anyway), normalises a q or k head with its weight, rotates it, and writes q,
k and v, and K/V into the pool (quantized for an fp8 pool, as ``triton_fused._to_pool`` does).

It rounds where the two kernels round: the product to the activations' dtype (what cuBLAS writes), then the row
factor, the norm and RoPE as ``qk_norm_rope``. The product's fp32 sum runs in another order than cuBLAS's, so the
bits differ within the bf16 bounds of the GPU tests; its own test checks it against the two-kernel path.

Only for batches of at most MAX_ROWS tokens: a prefill step's GEMM is compute-bound, where cuBLAS is the faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_interpreting
from .pdl import pdl_launch, pdl_wait
from .triton_fused import _fp8_format, _to_pool

MAX_ROWS = 256  # the largest decode batch the engine captures in a graph by default
BLOCK_K = 128


@triton.jit
def _qkv_rope_kernel(H, W, QW, KW, CosSin, Pos, QOut, KOut, VOut, KCache, VCache, OutLoc,
                     num_rows, stride_h, stride_w, stride_cs, stride_q, stride_k, stride_v, stride_cache_t,
                     eps, hid_eps, k_scale, v_scale,
                     HIDDEN: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                     HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr, SCALED: tl.constexpr,
                     FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOTS: tl.constexpr, PDL: tl.constexpr):
    HALF: tl.constexpr = D // 2
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < num_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, HALF)
    ks = tl.arange(0, BLOCK_K)
    # B tiles [BLOCK_K, HALF] of the weight [N, HIDDEN] (row-major: K runs along a row): the head's two halves
    b1 = W + (head * D + cols).to(tl.int64)[None, :] * stride_w + ks[:, None]
    b2 = b1 + HALF * stride_w
    a = H + rows64[:, None] * stride_h + ks[None, :]
    pdl_wait(PDL)  # H is the previous kernel's output
    acc1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for _ in range(0, HIDDEN, BLOCK_K):
        x = tl.load(a, mask=r_mask[:, None], other=0.0)
        xf = x.to(tl.float32)
        w1, w2 = tl.load(b1), tl.load(b2)
        if F32_DOTS:  # Triton's interpreter multiplies bf16 tiles wrongly; their products are exact in fp32
            acc1 = tl.dot(xf, w1.to(tl.float32), acc1)
            acc2 = tl.dot(xf, w2.to(tl.float32), acc2)
        else:
            acc1 = tl.dot(x, w1, acc1)
            acc2 = tl.dot(x, w2, acc2)
        sq += tl.sum(xf * xf, axis=1)  # the deferred input norm's sum of squares, from the rows the product reads
        a += BLOCK_K
        b1 += BLOCK_K
        b2 += BLOCK_K
    dtype = H.dtype.element_ty
    row_scale = tl.rsqrt(sq / HIDDEN + hid_eps)[:, None]
    # the product as cuBLAS writes it, then scaled by the row's norm factor (qk_norm_rope's order)
    x1 = (acc1.to(dtype).to(tl.float32) * row_scale).to(dtype)
    x2 = (acc2.to(dtype).to(tl.float32) * row_scale).to(dtype)
    mask = r_mask[:, None]
    cache_dtype = KCache.dtype.element_ty
    if head < HQ + HKV:  # a q or k head: normalised with its weight, then rotated
        if HAS_NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            inv = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / D + eps)[:, None]
            is_q = head < HQ
            w1 = tl.where(is_q, tl.load(QW + cols), tl.load(KW + cols))[None, :].to(tl.float32)
            w2 = tl.where(is_q, tl.load(QW + HALF + cols), tl.load(KW + HALF + cols))[None, :].to(tl.float32)
            x1 = (w1 * (f1 * inv).to(dtype).to(tl.float32)).to(dtype)
            x2 = (w2 * (f2 * inv).to(dtype).to(tl.float32)).to(dtype)
        pos = tl.load(Pos + rows, mask=r_mask, other=0).to(tl.int64)[:, None]
        cos = tl.load(CosSin + pos * stride_cs + cols[None, :], mask=mask, other=0.0).to(dtype).to(tl.float32)
        sin = tl.load(CosSin + pos * stride_cs + HALF + cols[None, :], mask=mask, other=0.0).to(dtype)
        sin = sin.to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((a1 * cos).to(dtype).to(tl.float32) - (a2 * sin).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)).to(dtype)
        if head < HQ:
            q_dst = QOut + rows64[:, None] * stride_q + head * D + cols[None, :]
            tl.store(q_dst, o1, mask=mask)
            tl.store(q_dst + HALF, o2, mask=mask)
        else:
            kv_head = head - HQ
            k_dst = KOut + rows64[:, None] * stride_k + kv_head * D + cols[None, :]
            tl.store(k_dst, o1, mask=mask)
            tl.store(k_dst + HALF, o2, mask=mask)
            if STORE_KV:
                slot = tl.load(OutLoc + rows, mask=r_mask, other=0).to(tl.int64)[:, None]
                kc_dst = KCache + slot * stride_cache_t + kv_head * D + cols[None, :]
                tl.store(kc_dst, _to_pool(o1, k_scale, SCALED, FP8_MAX, FP8_MANT, FP8_MIN_EXP, cache_dtype),
                         mask=mask)
                tl.store(kc_dst + HALF, _to_pool(o2, k_scale, SCALED, FP8_MAX, FP8_MANT, FP8_MIN_EXP, cache_dtype),
                         mask=mask)
    else:  # a v head: stored as projected and scaled
        v_head = head - HQ - HKV
        v_dst = VOut + rows64[:, None] * stride_v + v_head * D + cols[None, :]
        tl.store(v_dst, x1, mask=mask)
        tl.store(v_dst + HALF, x2, mask=mask)
        if STORE_KV:
            v_slot = tl.load(OutLoc + rows, mask=r_mask, other=0).to(tl.int64)[:, None]
            vc_dst = VCache + v_slot * stride_cache_t + v_head * D + cols[None, :]
            tl.store(vc_dst, _to_pool(x1, v_scale, SCALED, FP8_MAX, FP8_MANT, FP8_MIN_EXP, cache_dtype), mask=mask)
            tl.store(vc_dst + HALF, _to_pool(x2, v_scale, SCALED, FP8_MAX, FP8_MANT, FP8_MIN_EXP, cache_dtype),
                     mask=mask)


def applies(hidden: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel takes this projection: a batch of 2 to MAX_ROWS rows (one row takes the GEMV path), a
    hidden size in whole K blocks, heads whose halves are at least 16 wide (``tl.dot``) and a power of two."""
    return (2 <= hidden.shape[0] <= MAX_ROWS and hidden.stride(-1) == 1 and weight.stride(-1) == 1
            and weight.shape[1] == hidden.shape[1] and hidden.shape[1] % BLOCK_K == 0
            and head_dim >= 32 and (head_dim & (head_dim - 1)) == 0)


def _block_m(rows: int) -> int:
    """Rows per program: enough programs (rows / BLOCK_M x heads) to cover the SMs at small batches."""
    return 16 if rows <= 64 else 32 if rows <= 128 else 64


def qkv_norm_rope(hidden: torch.Tensor, weight: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
                  head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                  hidden_eps: float, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                  kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  kv_scales: tuple[float, float] = (1.0, 1.0), launch: tuple[int, int, int, int] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] of the rows ``hidden`` [T, HIDDEN] (the residual stream; the input norm's
    weight folded into ``weight`` [(Hq + 2 Hkv) D, HIDDEN]): the projection, each row scaled by rsqrt(mean(h^2) +
    hidden_eps), q and k heads normalised with their weights (when given) and rotated by the cos|sin table at
    ``positions``; ``kv_store`` = (k_cache, v_cache, out_loc) as in ``triton_fused.qk_norm_rope``. ``launch``
    (rows per program, K block, warps, stages) overrides the engine's choice (benchmarks)."""
    T, hidden_size = hidden.shape
    assert applies(hidden, weight, head_dim), "qkv_norm_rope: shapes the kernel does not take"
    assert weight.shape[0] == (num_qo_heads + 2 * num_kv_heads) * head_dim
    q = torch.empty(T, num_qo_heads, head_dim, dtype=hidden.dtype, device=hidden.device)
    k = torch.empty(T, num_kv_heads, head_dim, dtype=hidden.dtype, device=hidden.device)
    v = torch.empty(T, num_kv_heads, head_dim, dtype=hidden.dtype, device=hidden.device)
    has_norm = q_weight is not None and k_weight is not None
    qw = q_weight if has_norm else cos_sin_cache  # unused when there is no norm
    kw = k_weight if has_norm else cos_sin_cache
    if kv_store is not None:
        k_cache, v_cache, out_loc = kv_store
        assert k_cache.shape[1:] == (num_kv_heads, head_dim) and k_cache.stride() == v_cache.stride()
        assert k_cache.stride()[1:] == (head_dim, 1)
        cache_stride = k_cache.stride(0)
    else:
        k_cache = v_cache = out_loc = q  # unused
        cache_stride = 0
    fp8_max, fp8_mant, fp8_min_exp = _fp8_format(k_cache.dtype)
    block_m, block_k, warps, stages = launch or (_block_m(T), BLOCK_K, 4, 3)
    assert hidden_size % block_k == 0
    pdl, pdl_options = pdl_launch(hidden.device)
    _qkv_rope_kernel[(triton.cdiv(T, block_m), num_qo_heads + 2 * num_kv_heads)](
        hidden, weight, qw, kw, cos_sin_cache, positions, q, k, v, k_cache, v_cache, out_loc,
        T, hidden.stride(0), weight.stride(0), cos_sin_cache.stride(0), q.stride(0), k.stride(0), v.stride(0),
        cache_stride, eps, hidden_eps, float(kv_scales[0]), float(kv_scales[1]),
        HIDDEN=hidden_size, HQ=num_qo_heads, HKV=num_kv_heads, D=head_dim, HAS_NORM=has_norm,
        STORE_KV=kv_store is not None, SCALED=tuple(kv_scales) != (1.0, 1.0), FP8_MAX=fp8_max, FP8_MANT=fp8_mant,
        FP8_MIN_EXP=fp8_min_exp, BLOCK_M=block_m, BLOCK_K=block_k, F32_DOTS=triton_interpreting(), PDL=pdl,
        num_warps=warps, num_stages=stages,
        **pdl_options,
    )
    return q, k, v
