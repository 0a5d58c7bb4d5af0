"""Argmax over 16-bit GPU logits as int32, ``torch.argmax``'s answer (first index of the largest; the first NaN
wins). Programs read a row's chunks side by side (PyTorch: one per row), a small kernel picks among the chunks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_wait

CHUNK = 8192  # logits per program: 16 KB of bf16, eight 1,024-wide blocks
BLOCK = 1024
_NO_INDEX = 2**31 - 1


@triton.jit
def _first_max(values, indices, NO_INDEX: tl.constexpr):
    """The first (smallest) index of the largest value among the lanes (NaN above all numbers)."""
    is_nan = values != values
    nan_index = tl.min(tl.where(is_nan, indices, NO_INDEX), 0)
    best = tl.max(tl.where(is_nan, float("-inf"), values), 0)
    num_index = tl.min(tl.where((values == best) & ~is_nan, indices, NO_INDEX), 0)
    has_nan = nan_index != NO_INDEX
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, nan_index, num_index)


@triton.jit
def _argmax_chunks_kernel(Logits, ChunkVal, ChunkIdx, V, stride_row, num_chunks,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr, NO_INDEX: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = Logits + row.to(tl.int64) * stride_row
    cols = chunk * CHUNK + tl.arange(0, BLOCK)
    # lanes see columns in increasing order: a strict "greater" keeps the first of equals, and the first NaN
    best = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best_idx = tl.where(cols < V, cols, NO_INDEX)
    for start in range(BLOCK, CHUNK, BLOCK):
        c = cols + start
        x = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        take = (x > best) | ((x != x) & (best == best))  # a masked column (-inf) never takes
        best = tl.where(take, x, best)
        best_idx = tl.where(take, c, best_idx)
    value, index = _first_max(best, best_idx, NO_INDEX)
    tl.store(ChunkVal + row * num_chunks + chunk, value)
    tl.store(ChunkIdx + row * num_chunks + chunk, index)


@triton.jit
def _argmax_rows_kernel(ChunkVal, ChunkIdx, Out, num_chunks, BLOCK_C: tl.constexpr, NO_INDEX: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    values = tl.load(ChunkVal + row * num_chunks + offs, mask=mask, other=float("-inf"))
    indices = tl.load(ChunkIdx + row * num_chunks + offs, mask=mask, other=NO_INDEX)
    _, index = _first_max(values, indices, NO_INDEX)
    tl.store(Out + row, index)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and vocab < _NO_INDEX
    num_chunks = triton.cdiv(vocab, CHUNK)
    out = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    chunk_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    pdl, pdl_options = pdl_launch(logits.device)
    _argmax_chunks_kernel[(rows, num_chunks)](logits, chunk_val, chunk_idx, vocab, logits.stride(0), num_chunks,
                                              CHUNK=CHUNK, BLOCK=BLOCK, NO_INDEX=_NO_INDEX, PDL=pdl, num_warps=4,
                                              **pdl_options)
    _argmax_rows_kernel[(rows,)](chunk_val, chunk_idx, out, num_chunks, BLOCK_C=triton.next_power_of_2(num_chunks),
                                 NO_INDEX=_NO_INDEX, PDL=pdl, num_warps=1, **pdl_options)
    return out
