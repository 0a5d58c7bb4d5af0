"""Triton decode step of the gated delta rule, updating the state pool in place (the torch reference gathers,
updates and scatters it: three passes). One program per (request, v-head, block of Dv columns); graph-capturable."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _recurrent_step_kernel(x_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr, x_stride, scale,
                           HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    # x [B, 2 HK DK + HV DV] (q|k|v), g [B, HV] fp32 log decay, beta [B, HV], o [B, HV, DV], state fp32, slots int64
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)  # consecutive v-heads share a k-head
    slot = tl.load(slots_ptr + b)
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    row = x_ptr + b * x_stride
    q = tl.load(row + hk * DK + dk).to(tl.float32)
    k = tl.load(row + HK * DK + hk * DK + dk).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + hv * DV + dv).to(tl.float32)
    # L2 norm as FLA / HF: x * rsqrt(sum(x^2) + 1e-6)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
    g = tl.load(g_ptr + b * HV + hv).to(tl.float32)
    beta = tl.load(beta_ptr + b * HV + hv).to(tl.float32)
    s_ptrs = state_ptr + ((slot * HV + hv) * DK + dk[:, None]) * DV + dv[None, :]
    s = tl.load(s_ptrs) * tl.exp(g)
    u = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * u[None, :]
    tl.store(s_ptrs, s)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + (b * HV + hv) * DV + dv, o.to(o_ptr.dtype.element_ty))


def recurrent_gated_delta_rule_inplace(x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state_pool: torch.Tensor,
                                       slots: torch.Tensor, num_k_heads: int, head_k_dim: int) -> torch.Tensor:
    """x [B, conv_dim] (q|k|v after the conv), g/beta [B, Hv], state_pool [slots, Hv, Dk, Dv] fp32 -> o [B, Hv, Dv]."""
    B = x.shape[0]
    _, HV, DK, DV = state_pool.shape
    assert DK == head_k_dim and x.stride(-1) == 1 and state_pool.is_contiguous()
    o = x.new_empty(B, HV, DV)
    BV = min(DV, 32)
    grid = (B, HV, triton.cdiv(DV, BV))
    _recurrent_step_kernel[grid](x, g.contiguous(), beta.contiguous(), o, state_pool, slots, x.stride(0), DK**-0.5,
                                 HK=num_k_heads, HV=HV, DK=DK, DV=DV, BV=BV)
    return o
