"""PyTorch references for Qwen3.5's linear attention: the causal depthwise conv and the gated delta rule, on
token-major tensors. Per token (q, k unit-norm, q scaled by 1/sqrt(Dk), log decay g <= 0, beta in (0, 1)) the
state S [heads, Dk, Dv] does: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q.

The chunked form (G_i: cumulative log decay in the chunk, S: the state entering it) solves the unit
lower-triangular system u_i = beta_i (v_i - e^{G_i} S^T k_i - sum_{j<i} e^{G_i-G_j} (k_i . k_j) u_j) for all chunks
at once; then o_i = e^{G_i} S^T q_i + sum_{j<=i} e^{G_i-G_j} (q_i . k_j) u_j and
S_next = e^{G_C} S + sum_j e^{G_C-G_j} k_j u_j^T cost two small matmuls per chunk."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # the formula of FLA / HF (rsqrt of the sum of squares plus eps), not F.normalize's max(norm, eps)
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor,
                          conv_state: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [L, C] one request's new tokens, weight [C, K], conv_state [C, K-1] (the K-1 inputs before x; None: a
    fresh request, zeros). Returns (silu(conv) [L, C], the new conv state [C, K-1])."""
    L, C = x.shape
    K = weight.shape[-1]
    prev = x.new_zeros(C, K - 1) if conv_state is None else conv_state.to(x.dtype)
    window = torch.cat([prev, x.t()], dim=-1)  # [C, K-1+L]
    # output t sees inputs t-K+1 .. t: K shifted multiply-adds (a depthwise F.conv1d is ~10x slower on CPU here)
    out = window[:, :L] * weight[:, :1]
    for j in range(1, K):
        out = out + window[:, j : j + L] * weight[:, j : j + 1]
    return F.silu(out).t(), window[:, -(K - 1) :]


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor,
                         conv_state: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode: x [B, C] one token per request, conv_state [B, C, K-1]. Returns (silu(conv) [B, C], new state)."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
    return F.silu((window * weight).sum(dim=-1)), window[:, :, 1:]


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise (fp32), scale q, and repeat each k-head for the v-heads it serves (consecutive groups)."""
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    group = num_v_heads // k.shape[-2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q, k


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token per request: q/k [B, Hk, Dk], v [B, Hv, Dv], g/beta [B, Hv], state [B, Hv, Dk, Dv] -> (o, state)."""
    q, k = _prepare_qk(q, k, v.shape[-2])
    v, g, beta = v.float(), g.float(), beta.float()
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(dim=-2)  # S^T k: [B, Hv, Dv]
    u = beta[..., None] * (v - predicted)
    state = state + k[..., None] * u[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor | None,
    chunk_size: int = CHUNK_SIZE,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One request's segment. q/k [L, Hk, Dk], v [L, Hv, Dv], g/beta [L, Hv], state [Hv, Dk, Dv] (None: zeros).
    Returns (o [L, Hv, Dv] fp32, the state after the segment [Hv, Dk, Dv] fp32)."""
    L, H, Dv = v.shape
    q, k = _prepare_qk(q, k, H)
    Dk = k.shape[-1]
    C = min(chunk_size, L)  # any chunk size gives the same result; short segments need no padding
    pad = (C - L % C) % C
    # heads first: [H, L, D]. Padded tokens have k = v = beta = 0 and g = 0: they neither decay nor write.
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v.float()))
    g, beta = (F.pad(x.float().t(), (0, pad)) for x in (g, beta))
    n = (L + pad) // C
    q, k, v = (x.reshape(H, n, C, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, C), beta.reshape(H, n, C)

    G = g.cumsum(dim=-1)  # [H, n, C] cumulative log decay inside each chunk
    later = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)  # j > i
    # e^{G_i - G_j} for j <= i; j > i is masked before exp (G_i - G_j > 0 there and could overflow)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(later, float("-inf")).exp()  # [H, n, C, C]
    kb = k * beta[..., None]
    A = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)  # beta_i e^{G_i-G_j} k_i.k_j for j < i
    system = torch.eye(C, device=q.device) + A
    u_free = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * G.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # e^{G_i-G_j} q_i.k_j, j <= i
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]  # e^{G_C - G_j} k_j
    chunk_decay = G[..., -1].exp()[..., None, None]  # [H, n, 1, 1]

    S = q.new_zeros(H, Dk, Dv) if state is None else state.float()
    out = torch.empty_like(v)
    for c in range(n):
        u = u_free[:, c] - w[:, c] @ S  # [H, C, Dv]
        out[:, c] = q_decayed[:, c] @ S + attn[:, c] @ u
        S = chunk_decay[:, c] * S + k_to_end[:, c].transpose(-1, -2) @ u
    return out.reshape(H, n * C, Dv)[:, :L].transpose(0, 1), S
