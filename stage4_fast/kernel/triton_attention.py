"""Triton paged attention reading K/V through ``page_table[table_idx[b], pos]``. Decode grid (batch, kv_head,
split): a program owns one KV head's query heads and one slice of the sequence; a second kernel merges slices by
log-sum-exp. fp8 K/V convert in registers (K scale in the softmax scale, V scale on the output); fp32 dots use IEEE
precision so fp32 runs match HF."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import triton_interpreting as _interpreting
from .jit import load_cuda_kernels
from .pdl import pdl_launch, pdl_wait

LOG2E = math.log2(math.e)  # the kernels' softmax runs in base 2: exp(x) = exp2(x * log2(e))
LN2: tl.constexpr = tl.constexpr(math.log(2.0))


def _dot_precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # None: the default, which only matters for fp32


def _fp16_dots(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """fp8 K/V under 16-bit queries: dots run in fp16 (fp8 is exact in fp16 and converts cheaply; fp16 has more
    mantissa than bf16 and |q| stays far below 65504 after the q norm)."""
    return kv_dtype.itemsize == 1 and q_dtype in (torch.float16, torch.bfloat16)


@triton.jit
def _attend_key_block(q, acc, m_i, l_i, K, V, PageTable, row, pos, n_mask, visible, kv_head, offs_d, d_mask, stride_kt,
                      stride_kh, stride_vt, stride_vh, stride_pt, sm_scale, DOT_PRECISION: tl.constexpr,
                      MASKED: tl.constexpr, D_PADDED: tl.constexpr):
    """Fold keys at ``pos`` into the base-2 online softmax (``sm_scale`` includes log2(e)) of rows ``q``.
    ``visible`` [rows, keys] masks scores. MASKED=False: every key is in range and visible (no predicated loads).
    D_PADDED: head_dim is not a power of two, so padding columns stay masked (they would read garbage, and a NaN
    there makes the zero-padded q's dot NaN)."""
    if MASKED:
        slots = tl.load(PageTable + row * stride_pt + pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        slots = tl.load(PageTable + row * stride_pt + pos).to(tl.int64)
        kv_mask = d_mask[None, :]
    if MASKED or D_PADDED:
        k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :])
    k = k.to(q.dtype)  # a no-op unless the pool stores another dtype (fp8)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED or D_PADDED:
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :])
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Eager decodes reuse the graphs' compiled variant: num_splits is not specialised on, scratch is as wide as theirs
SCRATCH_SPLIT_ALIGN = 16
_DECODE_UNSPECIALISED = ["num_splits"]


@triton.jit(do_not_specialize=_DECODE_UNSPECIALISED)
def _decode_split_kernel(Q, K, V, PageTable, TableIdx, SeqLens, MidO, MidLse, Out, stride_qb, stride_qh, stride_kt,
                         stride_kh, stride_vt, stride_vh, stride_pt, stride_mob, stride_moh, stride_mos, stride_mlb,
                         stride_mlh, stride_ob, stride_oh, sm_scale, v_scale, num_splits, GROUP: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                         DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr,
                         WHOLE_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(TableIdx + b).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if FP16_DOTS:  # fp8 K/V convert to fp16 exactly and cheaply; the dots then run in fp16 (see _fp16_dots)
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if WHOLE_BLOCKS:  # the split's whole blocks unmasked, then its partial last block (see DECODE_WHOLE_BLOCKS_FP8)
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, full_end, BLOCK_N):
            pos = n0 + offs_n
            acc, m_i, l_i = _attend_key_block(q, acc, m_i, l_i, K, V, PageTable, row, pos, pos, pos, kv_head, offs_d,
                                              d_mask, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, sm_scale,
                                              DOT_PRECISION, False, BLOCK_D != HEAD_DIM)
        if full_end < end:
            pos = full_end + offs_n
            n_mask = pos < end
            acc, m_i, l_i = _attend_key_block(q, acc, m_i, l_i, K, V, PageTable, row, pos, n_mask, n_mask[None, :],
                                              kv_head, offs_d, d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
                                              stride_pt, sm_scale, DOT_PRECISION, True, BLOCK_D != HEAD_DIM)
    else:  # every block masked
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            n_mask = pos < end
            acc, m_i, l_i = _attend_key_block(q, acc, m_i, l_i, K, V, PageTable, row, pos, n_mask, n_mask[None, :],
                                              kv_head, offs_d, d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
                                              stride_pt, sm_scale, DOT_PRECISION, True, BLOCK_D != HEAD_DIM)

    out_mask = h_mask[:, None] & d_mask[None, :]
    acc = acc * v_scale  # the V scale of an fp8 pool (1.0 otherwise); merging the splits is linear in it
    if DIRECT:  # a single split: its result is final
        out = acc / l_i[:, None]
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        has_keys = l_i > 0  # a split past the end of a short sequence holds nothing
        out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("-inf"))  # natural log
        tl.store(MidO + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
                 out, mask=out_mask)
        tl.store(MidLse + b * stride_mlb + heads * stride_mlh + split, lse, mask=h_mask)


@triton.jit(do_not_specialize=_DECODE_UNSPECIALISED)
def _decode_combine_kernel(MidO, MidLse, Out, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob,
                           stride_oh, num_splits, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_mlb + head * stride_mlh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: split 0 always holds the first key
    w = tl.exp(lse - m)
    w = w / tl.sum(w, 0)
    o = tl.load(MidO + b * stride_mob + head * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


def decode_num_splits(batch_size: int, num_kv_heads: int, max_splits: int, num_sms: int = 132,
                      cuda_fp8: bool = False) -> int:
    """Split-K factor: about DECODE_PROGRAMS_PER_SM programs per SM; depends on the batch size only."""
    if _interpreting():
        return min(2, max_splits)  # exercise the merge path, cheaply
    per_sm = DECODE_PROGRAMS_PER_SM_CUDA_FP8 if cuda_fp8 else DECODE_PROGRAMS_PER_SM
    return max(1, min(max_splits, math.ceil(per_sm * num_sms / max(1, batch_size * num_kv_heads))))


# GPU decode launch (key block, warps, stages); fp32 tiles are twice as large, so 64-key blocks.
DECODE_BLOCK_N = 128
DECODE_LAUNCH_16BIT = (DECODE_BLOCK_N, 4, 2)
DECODE_LAUNCH_FP32 = (64, 4, 3)
# fp8 KV under 16-bit queries: a register cap, and 5 stages (the first depth that double-buffers the K/V tiles)
DECODE_LAUNCH_FP8 = (64, 4, 5)
DECODE_MAXNREG_FP8: int | None = 128
# split-K target: programs (batch x KV heads x splits) per SM
DECODE_PROGRAMS_PER_SM = 11
# the CUDA fp8 kernel's: a split costs it more than it saves (dependent loads before its first tile)
DECODE_PROGRAMS_PER_SM_CUDA_FP8 = 1
# unmasked whole blocks pay where the kernel is instruction bound (fp8), not where it is bytes bound (16-bit)
DECODE_WHOLE_BLOCKS_FP8 = True
DECODE_WHOLE_BLOCKS_16BIT = False


# fp8 pool: csrc/decode_fp8.cu where it applies (sm_89+, head_dim 128, group <= 8; no 8x head padding)
DECODE_FP8_CUDA_STAGES = 2  # its tiles per warp in shared memory (2-4): one computes while cp.async fills the others
DECODE_FP8_CUDA_HEADS_FIRST = True  # its grid: a sequence's KV heads side by side (True), else a head's sequences
# its warps per program: 8 below this many programs per SM (more KV in flight), else 4
DECODE_FP8_CUDA_WIDE_BELOW = 2


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_sms(device: torch.device) -> int:
    return _sm_count(_device_index(device))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cuda_fp8_decode_warps(programs: int, num_sms: int) -> int:
    return 8 if programs < DECODE_FP8_CUDA_WIDE_BELOW * num_sms else 4


@functools.cache
def _has_fp8_conversions(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def cuda_fp8_decode_applies(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int,
                            device: torch.device) -> bool:
    """Whether a decode with these shapes takes the CUDA fp8 kernel (see DECODE_FP8_CUDA_STAGES)."""
    if (_interpreting() or device.type != "cuda" or kv_dtype.itemsize != 1 or head_dim != 128 or group > 8
            or q_dtype not in (torch.float16, torch.bfloat16) or not _has_fp8_conversions(_device_index(device))):
        return False
    module = load_cuda_kernels()
    return module is not None and hasattr(module, "decode_fp8")


def cuda_fp8_decode_module(q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor):
    group = q.shape[1] // k_cache.shape[1]
    if page_table.stride(0) % 4 or not cuda_fp8_decode_applies(q.dtype, k_cache.dtype, q.shape[-1], group, q.device):
        return None
    return load_cuda_kernels()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     table_idx: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, num_splits: int,
                     out: torch.Tensor | None = None, mid_o: torch.Tensor | None = None,
                     mid_lse: torch.Tensor | None = None, block_n: int | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, cuda_stages: int | None = None, cuda_heads_first: bool | None = None,
                     cuda_warps: int | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [slots, Hkv, D] (fp8: x k/v_scale); page_table [rows, width], table_idx / seq_lens
    [B] int32; mid_o [B', Hq, S', D] / mid_lse [B', Hq, S'] fp32 scratch. block_n forces the Triton kernel."""
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_qo_heads // num_kv_heads
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    cuda = None if block_n else cuda_fp8_decode_module(q, k_cache, page_table)
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(16, triton.next_power_of_2(group))
    fp8 = k_cache.dtype.itemsize == 1
    default_block_n, num_warps, num_stages = (DECODE_LAUNCH_FP32 if q.dtype == torch.float32 else
                                              DECODE_LAUNCH_FP8 if fp8 else DECODE_LAUNCH_16BIT)
    block_n = 16 if _interpreting() else (block_n or default_block_n)
    launch = {} if _interpreting() else dict(num_warps=num_warps, num_stages=num_stages)
    if fp8 and q.dtype != torch.float32 and DECODE_MAXNREG_FP8 and not _interpreting():
        launch["maxnreg"] = DECODE_MAXNREG_FP8
    pdl, pdl_options = pdl_launch(q.device)
    direct = num_splits == 1
    if direct:
        mo = ml = out.new_empty(0, dtype=torch.float32)
    elif mid_o is None:  # the graphs' layout (see SCRATCH_SPLIT_ALIGN): same strides, same compiled kernel
        width = triton.cdiv(num_splits, SCRATCH_SPLIT_ALIGN) * SCRATCH_SPLIT_ALIGN
        mo = torch.empty(batch, num_qo_heads, width, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(batch, num_qo_heads, width, dtype=torch.float32, device=q.device)
    else:
        assert mid_lse is not None
        mo, ml = mid_o, mid_lse
    mo_strides, ml_strides = ((0, 0, 0), (0, 0)) if direct else (mo.stride()[:3], ml.stride()[:2])
    if cuda is not None:
        cuda.decode_fp8(q, k_cache, v_cache, page_table, table_idx, seq_lens, mo, ml, out, sm_scale * k_scale * LOG2E,
                        v_scale, num_splits, cuda_stages or DECODE_FP8_CUDA_STAGES,
                        DECODE_FP8_CUDA_HEADS_FIRST if cuda_heads_first is None else cuda_heads_first,
                        cuda_warps or cuda_fp8_decode_warps(batch * num_kv_heads * num_splits, _num_sms(q.device)), pdl)
    else:
        _decode_split_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, page_table, table_idx, seq_lens, mo, ml, out,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            page_table.stride(0), *mo_strides, *ml_strides, out.stride(0), out.stride(1),
            sm_scale * k_scale * LOG2E, v_scale, num_splits,
            GROUP=group, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, HEAD_DIM=head_dim, DIRECT=direct,
            DOT_PRECISION=_dot_precision(q.dtype), FP16_DOTS=_fp16_dots(q.dtype, k_cache.dtype), PDL=pdl,
            WHOLE_BLOCKS=DECODE_WHOLE_BLOCKS_FP8 if fp8 else DECODE_WHOLE_BLOCKS_16BIT, **launch, **pdl_options,
        )
    if not direct:
        _decode_combine_kernel[(batch, num_qo_heads)](
            mo, ml, out, *mo_strides, *ml_strides, out.stride(0), out.stride(1), num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, HEAD_DIM=head_dim, PDL=pdl, **pdl_options,
        )
    return out
