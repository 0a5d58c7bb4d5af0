"""Triton prefill (extend) attention: ragged causal queries over a cached prefix, through the token-slot page
table. With a block map (``prefill_block_map``) the grid is a device-side work list, so one CUDA graph serves
every batch of its token count (engine/prefill_graph.py)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import triton_interpreting as _interpreting
from .triton_attention import LOG2E, _attend_key_block, _dot_precision, _fp16_dots


@triton.jit
def _prefill_kernel(Q, K, V, Out, PageTable, TableIdx, CuSeqlensQ, SeqLens, BlockMap, stride_qt, stride_qh, stride_kt,
                    stride_kh, stride_vt, stride_vh, stride_pt, stride_ot, stride_oh, sm_scale, v_scale,
                    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr,
                    MAPPED: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    """One program per (request, KV head, BLOCK_M query tokens); rows: tokens x GROUP_P2 heads, token-major. Key
    blocks below the diagonal run unmasked. MAPPED: grid = ``BlockMap`` entries x KV heads, extra programs return."""
    if MAPPED:  # a 1-D grid: the map's entries in its order, each for every KV head in turn
        entry = tl.program_id(0) // NUM_KV_HEADS
        kv_head = tl.program_id(0) % NUM_KV_HEADS
        live = entry < tl.load(BlockMap)
        entry = tl.where(live, entry, 0)  # a program past the count reads entry 0 (always there), returns below
        b = tl.load(BlockMap + 1 + 2 * entry)
        m_block = tl.load(BlockMap + 2 + 2 * entry)
    else:
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        m_block = tl.program_id(2)
    q_start = tl.load(CuSeqlensQ + b)
    q_len = tl.load(CuSeqlensQ + b + 1) - q_start
    if MAPPED:
        q_len = tl.where(live, q_len, 0)
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(SeqLens + b)
    prefix = seq_len - q_len
    row = tl.load(TableIdx + b).to(tl.int64)

    ROWS: tl.constexpr = BLOCK_M * GROUP_P2
    offs_r = tl.arange(0, ROWS)
    offs_m = m_block * BLOCK_M + offs_r // GROUP_P2  # the row's query token within the request
    head = kv_head * GROUP + offs_r % GROUP_P2
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    r_mask = (offs_m < q_len) & (offs_r % GROUP_P2 < GROUP)
    d_mask = offs_d < HEAD_DIM
    tokens = (q_start + offs_m).to(tl.int64)
    q_ptrs = tokens[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if FP16_DOTS:
        q = q.to(tl.float16)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    # keys up to the block's first token's position are seen by every row: whole blocks of them run unmasked
    seen_by_all = prefix + m_block * BLOCK_M + 1
    full_end = seen_by_all // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + offs_n
        acc, m_i, l_i = _attend_key_block(q, acc, m_i, l_i, K, V, PageTable, row, pos, pos, pos, kv_head, offs_d,
                                          d_mask, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, sm_scale,
                                          DOT_PRECISION, False, BLOCK_D != HEAD_DIM)
    end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)  # the causal horizon of this query block
    for n0 in range(full_end, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        visible = n_mask[None, :] & (pos[None, :] <= (prefix + offs_m)[:, None])  # key 0: every row sees one
        acc, m_i, l_i = _attend_key_block(q, acc, m_i, l_i, K, V, PageTable, row, pos, n_mask, visible, kv_head, offs_d,
                                          d_mask, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, sm_scale,
                                          DOT_PRECISION, True, BLOCK_D != HEAD_DIM)
    out = acc / l_i[:, None] * v_scale
    tl.store(Out + tokens[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


# GPU prefill launch: query rows per program, key block, warps, stages (16-bit and fp8 pools alike)
PREFILL_LAUNCH_16BIT = (128, 64, 4, 3)
PREFILL_LAUNCH_FP32 = (64, 64, 4, 3)  # fp32 tiles are twice as large: 64 rows


def prefill_launch(q_dtype: torch.dtype) -> tuple[int, int, int, int]:
    return PREFILL_LAUNCH_FP32 if q_dtype == torch.float32 else PREFILL_LAUNCH_16BIT


def prefill_block_m(q_dtype: torch.dtype, group: int) -> int:
    rows = 16 if _interpreting() else prefill_launch(q_dtype)[0]
    group_p2 = triton.next_power_of_2(group)
    return max(rows, 16, group_p2) // group_p2  # tl.dot wants 16 rows or more


def prefill_block_map(seqlens_q: np.ndarray, seqlens_k: np.ndarray, block_m: int) -> np.ndarray:
    """int32 [1 + 2 N]: the count N of (request, query block) pairs, then the pairs, most keys first (they set the
    kernel's end). T query tokens give at most cdiv(T, block_m) + B pairs."""
    blocks = -(-seqlens_q // block_m)
    req = np.repeat(np.arange(len(seqlens_q), dtype=np.int32), blocks)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)
    m_block = np.arange(len(req), dtype=np.int32) - first
    keys = seqlens_k[req] - seqlens_q[req] + np.minimum((m_block + 1) * block_m, seqlens_q[req])
    order = np.argsort(-keys, kind="stable")
    out = np.empty(1 + 2 * len(req), np.int32)
    out[0] = len(req)
    out[1::2] = req[order]
    out[2::2] = m_block[order]
    return out


def prefill_block_map_capacity(num_tokens: int, max_reqs: int, block_m: int) -> int:
    """Entries a block map of a ``num_tokens``-token batch of at most ``max_reqs`` requests can have."""
    return triton.cdiv(num_tokens, block_m) + min(max_reqs, num_tokens)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                      table_idx: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_q: int,
                      sm_scale: float, out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                      block_map: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, Hq, D] (ragged by ``cu_seqlens_q`` [B+1]); this step's K/V already in the cache (fp8: x k/v_scale);
    seq_lens [B] = prefix + extend. ``block_map`` = (block_m, device map from ``prefill_block_map``)."""
    total, num_qo_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    batch = table_idx.shape[0]
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if batch == 0 or total == 0:
        return out
    group = num_qo_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    if _interpreting():
        block_n, options = 16, {}
    else:
        _, block_n, num_warps, num_stages = prefill_launch(q.dtype)
        options = dict(num_warps=num_warps, num_stages=num_stages)
    block_m = prefill_block_m(q.dtype, group)
    if block_map is not None:
        assert block_map[0] == block_m, "the block map was built for another query block"
        mapped = block_map[1]
        grid: tuple[int, ...] = ((mapped.shape[0] - 1) // 2 * num_kv_heads,)
    else:
        mapped = cu_seqlens_q  # unused
        grid = (batch, num_kv_heads, triton.cdiv(max_seqlen_q, block_m))
    _prefill_kernel[grid](q, k_cache, v_cache, out, page_table, table_idx, cu_seqlens_q, seq_lens, mapped, q.stride(0),
                          q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                          page_table.stride(0), out.stride(0), out.stride(1), sm_scale * k_scale * LOG2E, v_scale,
                          GROUP=group, GROUP_P2=group_p2, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_D=triton.next_power_of_2(head_dim), HEAD_DIM=head_dim,
                          DOT_PRECISION=_dot_precision(q.dtype), FP16_DOTS=_fp16_dots(q.dtype, k_cache.dtype),
                          MAPPED=block_map is not None, NUM_KV_HEADS=num_kv_heads, **options)
    return out
