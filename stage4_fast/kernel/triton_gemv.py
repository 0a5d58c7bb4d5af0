"""Triton GEMV for one-token forwards: y = x @ W.T (+ bias), x [1, K], optionally with the SiLU-and-mul of its
input (down_proj) or the add-RMSNorm before it (qkv, gate_up) folded in. At one row cuBLAS streams the weights
far below bandwidth; here each program owns BLOCK_N rows, accumulates fp32 over BLOCK_K slices and reduces once,
rounding once to the output dtype as cuBLAS does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_wait


@triton.jit
def _normed_input(X, R, k, k_mask, HAS_RESIDUAL: tl.constexpr):
    """A slice of the norm's input: x, or x + residual rounded once (as torch's 16-bit add)."""
    h = tl.load(X + k, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(R + k, mask=k_mask, other=0.0).to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def _input_slice(X, R, NormW, k, k_mask, K, rstd, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    if NORM:  # rounded where the add-RMSNorm kernel rounds: the normalised value, then its product with NormW
        h = _normed_input(X, R, k, k_mask, HAS_RESIDUAL)
        y = (h.to(tl.float32) * rstd).to(h.dtype)
        nw = tl.load(NormW + k, mask=k_mask, other=0.0)
        x = (nw.to(tl.float32) * y.to(tl.float32)).to(h.dtype).to(tl.float32)
    elif GATED:  # X = [gate | up], 2K wide: silu(gate) * up, rounded where the unfused kernels round
        g = tl.load(X + k, mask=k_mask, other=0.0)
        u = tl.load(X + K + k, mask=k_mask, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        x = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    else:
        x = tl.load(X + k, mask=k_mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(X, W, Bias, Y, R, NormW, ResOut, N, K, stride_wn, eps,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
    # weights depend on no earlier kernel: the first slice is read before the PDL wait
    w_first = tl.load(w_rows + offs_k[None, :], mask=row_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_wait(PDL)
    rstd = 0.0
    if NORM:  # the input is rms_norm(x [+ residual]) * NormW: its sum of squares first (x is 2 KB, in L2 for all)
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            h = _normed_input(X, R, k, k < K, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                if pid == 0:  # the new residual stream, written once (not in place: the other programs read R)
                    tl.store(ResOut + k, h, mask=k < K)
            hf = h.to(tl.float32)
            sum_sq += hf * hf
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # element-wise partial sums: one reduction at the end
    acc += w_first.to(tl.float32) * _input_slice(X, R, NormW, offs_k, offs_k < K, K, rstd, GATED, NORM,
                                                 HAS_RESIDUAL)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = _input_slice(X, R, NormW, k, k_mask, K, rstd, GATED, NORM, HAS_RESIDUAL)
        w = tl.load(w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_mask)


# Launch (output rows per program, K slice, warps): narrow outputs want 2 rows per program to cover the GPU.
GEMV_NARROW = (2, 1024, 4)
GEMV_WIDE = (8, 512, 2)
GEMV_WIDE_FROM = 4096  # outputs


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x [1, K] (``gated``: [1, 2K] = [gate | up] -> silu(gate) * up), weight [N, K], bias [N] -> [1, N]."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    n, k = weight.shape
    assert x.shape[1] == (2 * k if gated else k), f"x has {x.shape[1]} features, the weight {k}"
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, y, gated=gated)
    return y


def normed_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm`` then ``gemv`` in one kernel: x, residual [1, K] -> (y [1, N], the new residual stream)."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    n, k = weight.shape
    assert x.shape[1] == k and norm_weight.shape == (k,), f"x has {x.shape[1]} features, the weight {k}"
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if residual is None:
        _launch(x, weight, bias, y, norm=(x, norm_weight, x, eps), has_residual=False)
        return y, x
    assert residual.shape == x.shape and residual.stride(-1) == 1
    stream = torch.empty_like(x)
    _launch(x, weight, bias, y, norm=(residual, norm_weight, stream, eps), has_residual=True)
    return y, stream


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, gated: bool = False,
            norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
            has_residual: bool = False) -> None:
    n, k = weight.shape
    block_n, block_k, warps = GEMV_WIDE if n >= GEMV_WIDE_FROM else GEMV_NARROW
    residual, norm_weight, stream, eps = norm if norm is not None else (x, x, x, 0.0)  # unused without NORM
    pdl, pdl_options = pdl_launch(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, bias if bias is not None else weight, y, residual, norm_weight,
                                             stream, n, k, weight.stride(0), eps, HAS_BIAS=bias is not None,
                                             GATED=gated, NORM=norm is not None, HAS_RESIDUAL=has_residual, PDL=pdl,
                                             BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl_options)
