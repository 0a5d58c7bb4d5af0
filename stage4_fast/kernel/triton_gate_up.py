"""A decode batch's gate_up projection with the deferred post-attention norm and SiLU-and-mul in its epilogue: one
kernel where the deferred-norm layer (models/decoder.py) launches a cuBLAS GEMM and ``triton_fused.silu_and_mul``.

Why: a decode step's fixed cost is its ~200 kernels, not their bytes (bench/gpu_notes.md sections 13-29); the
SiLU-and-mul kernel re-reads the GEMM's output only to scale it by the row's norm factor and gate it. Here each
program owns the same BLOCK_N columns of the gate half and of the up half (two products over the same rows), so
a gated pair is in its registers when the K loop ends; the row's norm factor comes from the sum of squares of the
rows the products stream anyway. Unlike a qkv epilogue (a program must own a whole head there), the columns tile
freely, as a plain GEMM's do.

It rounds where the two kernels round: each product to the activations' dtype (what cuBLAS writes), then the row
factor, SiLU and the product as ``silu_and_mul``. The products' fp32 sums run in another order than cuBLAS's, so
the bits differ within the bf16 bounds of the GPU tests; its own test checks it against the two-kernel path.

Only for batches of at most MAX_ROWS tokens: a prefill step's GEMM is compute-bound, where cuBLAS is the faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_interpreting
from .pdl import pdl_launch, pdl_wait

MAX_ROWS = 256  # the largest decode batch the engine captures in a graph by default
Launch = tuple[int, int, int, int, int]  # rows per program, columns per half, K block, warps, stages


@triton.jit
def _gate_up_silu_kernel(H, W, Out, num_rows, stride_h, stride_w, stride_o, inter, hid_eps,
                         HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, F32_DOTS: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < num_rows
    c_mask = cols < inter
    ks = tl.arange(0, BLOCK_K)
    # B tiles [BLOCK_K, BLOCK_N] of the weight [2 * inter, HIDDEN] (row-major: K runs along a row): the gate rows
    # and the up rows of the same columns
    b_gate = W + cols.to(tl.int64)[None, :] * stride_w + ks[:, None]
    b_up = b_gate + inter * stride_w
    a = H + rows.to(tl.int64)[:, None] * stride_h + ks[None, :]
    pdl_wait(PDL)  # H is the previous kernel's output
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for _ in range(0, HIDDEN, BLOCK_K):
        x = tl.load(a, mask=r_mask[:, None], other=0.0)
        xf = x.to(tl.float32)
        wg = tl.load(b_gate, mask=c_mask[None, :], other=0.0)
        wu = tl.load(b_up, mask=c_mask[None, :], other=0.0)
        if F32_DOTS:  # Triton's interpreter multiplies bf16 tiles wrongly; their products are exact in fp32
            acc_gate = tl.dot(xf, wg.to(tl.float32), acc_gate)
            acc_up = tl.dot(xf, wu.to(tl.float32), acc_up)
        else:
            acc_gate = tl.dot(x, wg, acc_gate)
            acc_up = tl.dot(x, wu, acc_up)
        sq += tl.sum(xf * xf, axis=1)  # the deferred norm's sum of squares, from the rows the products read
        a += BLOCK_K
        b_gate += BLOCK_K
        b_up += BLOCK_K
    dtype = H.dtype.element_ty
    row_scale = tl.rsqrt(sq / HIDDEN + hid_eps)[:, None]
    # the products as cuBLAS writes them, scaled by the row's norm factor, then gated (silu_and_mul's order)
    g = (acc_gate.to(dtype).to(tl.float32) * row_scale).to(dtype).to(tl.float32)
    u = (acc_up.to(dtype).to(tl.float32) * row_scale).to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out = Out + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out, (s * u).to(dtype), mask=r_mask[:, None] & c_mask[None, :])


def applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this projection: a batch of 2 to MAX_ROWS rows (one row takes the GEMV path), a
    hidden size in whole K blocks of 64, contiguous rows and weights, an even number of weight rows."""
    return (2 <= hidden.shape[0] <= MAX_ROWS and hidden.stride(-1) == 1 and weight.stride(-1) == 1
            and weight.shape[1] == hidden.shape[1] and hidden.shape[1] % 64 == 0 and weight.shape[0] % 2 == 0)


def default_launch(rows: int, hidden_size: int) -> Launch:
    """Rows per program, columns per half, K block, warps and stages for a batch of ``rows``: the fastest Triton
    launch of bench/results/h200-gemm-sweep.md for the gate_up shape at that batch (a program's two halves of
    BLOCK_N columns are that sweep's tile of 2 BLOCK_N), with rows per program no larger than the batch needs."""
    block_k = 128 if hidden_size % 128 == 0 else 64
    if rows <= 16:
        return 16, 32, block_k, 4, 4
    if rows <= 32:
        return 32, 32, block_k, 4, 4
    if rows <= 64:
        return 64, 32, block_k, 4, 4
    if rows <= 128:
        return 128, 32, block_k, 8, 4
    return 128, 64, 64, 8, 4


def gate_up_silu(hidden: torch.Tensor, weight: torch.Tensor, hidden_eps: float,
                 launch: Launch | None = None) -> torch.Tensor:
    """silu(gate) * up [T, I] of the rows ``hidden`` [T, HIDDEN] (the residual stream; the post-attention norm's
    weight folded into ``weight`` [2 I, HIDDEN] = [gate | up]), gate and up first multiplied by each row's
    rsqrt(mean(h^2) + hidden_eps). ``launch`` overrides the engine's choice (benchmarks)."""
    T, hidden_size = hidden.shape
    assert applies(hidden, weight), "gate_up_silu: shapes the kernel does not take"
    inter = weight.shape[0] // 2
    out = torch.empty(T, inter, dtype=hidden.dtype, device=hidden.device)
    block_m, block_n, block_k, warps, stages = launch or default_launch(T, hidden_size)
    assert hidden_size % block_k == 0
    pdl, pdl_options = pdl_launch(hidden.device)
    _gate_up_silu_kernel[(triton.cdiv(T, block_m), triton.cdiv(inter, block_n))](
        hidden, weight, out, T, hidden.stride(0), weight.stride(0), out.stride(0), inter, hidden_eps,
        HIDDEN=hidden_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, F32_DOTS=triton_interpreting(),
        PDL=pdl, num_warps=warps, num_stages=stages, **pdl_options,
    )
    return out
