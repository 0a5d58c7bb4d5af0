"""Fused MoE: one grouped GEMM launch for every expert. (token, k) pairs are sorted by expert, each run padded to
a multiple of BLOCK_M, so each row block has one expert; padding ids (= num_tokens * top_k) are masked. The
alignment is torch with no host sync and worst-case sizes, so the MoE forward fits a CUDA graph. A few tokens skip
the sort: each pair gets a row block of its own (``unsorted_blocks``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Dict, Tuple

import torch
import triton
import triton.language as tl

from . import triton_interpreting
from .triton_fused import silu_and_mul

CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"


# the token counts unspecialised: else each new count's divisibility by 16 compiles a variant mid-prefill
@triton.jit(do_not_specialize=["num_valid_tokens", "num_sorted"])
def fused_moe_kernel(
    A, B, C, TopkWeights, SortedTokenIds, ExpertIds, NumTokensPostPadded, N, K, num_valid_tokens, num_sorted,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    MUL_ROUTED_WEIGHT: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grouped launch order: GROUP_M row blocks share each column sweep, so weight tiles stay in L2
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_sorted, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    if pid_m * BLOCK_M >= tl.load(NumTokensPostPadded):
        return
    offs_sorted = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_token = tl.load(SortedTokenIds + offs_sorted)
    token_mask = offs_token < num_valid_tokens
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (offs_token // TOP_K).to(tl.int64)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_ROUTED_WEIGHT:
        w = tl.load(TopkWeights + offs_token, mask=token_mask, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = C + offs_token.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=token_mask[:, None] & n_mask[None, :])


@triton.jit
def _topk_softmax_kernel(Logits, Weights, Ids, E, stride_l, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr,
                         RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    # one program per token: softmax over its experts in fp32, then top-k as k rounds of arg-max (k is small)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(Logits + t * stride_l + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    ks = tl.arange(0, K_BLOCK)
    weights = tl.zeros([K_BLOCK], dtype=tl.float32)
    ids = tl.zeros([K_BLOCK], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)  # a tie goes to the lower expert (padding lanes last)
        weights = tl.where(ks == k, best, weights)
        ids = tl.where(ks == k, idx, ids)
        p = tl.where(offs == idx, -1.0, p)  # probabilities are >= 0: taken out of the next rounds
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(Weights + t * TOP_K + ks, weights, mask=ks < TOP_K)
    tl.store(Ids + t * TOP_K + ks, ids, mask=ks < TOP_K)


def topk_softmax(gating_output: torch.Tensor, topk: int, renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``fused_topk`` (HF's router) in one launch, where torch takes five (softmax, top-k, sum, divide, cast):
    logits [M, E] -> (weights [M, k] fp32, expert ids [M, k] int32)."""
    m, e = gating_output.shape
    weights = torch.empty(m, topk, dtype=torch.float32, device=gating_output.device)
    ids = torch.empty(m, topk, dtype=torch.int32, device=gating_output.device)
    if m:
        _topk_softmax_kernel[(m,)](gating_output, weights, ids, e, gating_output.stride(0), TOP_K=topk,
                                   K_BLOCK=triton.next_power_of_2(topk), RENORMALIZE=renormalize,
                                   BLOCK_E=triton.next_power_of_2(e), num_warps=2)
    return weights, ids


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``sorted_ids`` [numel + E*(block-1)] (padding = numel), ``expert_ids`` (per row block) and
    ``num_tokens_post_pad`` [1] (the used length)."""
    flat = topk_ids.flatten().long()
    numel = flat.numel()
    device = flat.device
    max_padded = numel + num_experts * (block_size - 1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # (token, k) positions grouped by expert, in token order
    expert_of = flat[order]
    rank_in_expert = torch.arange(numel, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank_in_expert
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(triton.cdiv(max_padded, block_size), device=device) * block_size
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


@functools.lru_cache(maxsize=None)
def _pair_blocks(num_pairs: int, block_size: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((num_pairs, block_size), num_pairs, dtype=torch.int32, device=device)
    ids[:, 0] = torch.arange(num_pairs, dtype=torch.int32, device=device)
    return ids.view(-1), torch.tensor([ids.numel()], dtype=torch.int32, device=device)


def unsorted_blocks(topk_ids: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align_block_size``'s outputs for few tokens with no kernel at all: row block i holds pair i alone (its
    other rows padding), its expert is ``topk_ids`` itself; the ids depend only on the pair count (cached). An expert
    two pairs share is read twice, which the ~25 small kernels of the sort cost more than at a few tokens."""
    sorted_ids, num_post_pad = _pair_blocks(topk_ids.numel(), block_size, topk_ids.device)
    return sorted_ids, topk_ids.flatten().to(torch.int32), num_post_pad


@functools.lru_cache(maxsize=None)
def tuned_configs(num_experts: int, n: int, device_name: str) -> Dict[int, Dict[str, int]]:
    """SGLang's file format: ``moe_configs/E=..,N=..,device_name=...json`` (N: the intermediate size per rank) maps
    token counts to a config (BLOCK_SIZE_M, ..., num_warps, num_stages); written by ``python -m bench moe-tune``."""
    path = CONFIG_DIR / f"E={num_experts},N={n},device_name={device_name}.json"
    configs = json.loads(path.read_text()) if path.exists() else {}
    return {int(m): {k.replace("_SIZE", ""): v for k, v in c.items()} for m, c in configs.items()}


def get_moe_config(num_tokens: int, num_experts: int, n: int, dtype: torch.dtype) -> Dict[str, int]:
    if triton_interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1)
    # tuned in 16-bit: fp32 tiles of the same size may not fit the shared memory
    tuned = tuned_configs(num_experts, n, torch.cuda.get_device_name().replace(" ", "_")) if dtype.itemsize == 2 else {}
    if tuned:  # the nearest tuned token count
        return tuned[min(tuned, key=lambda m: abs(m - num_tokens))]
    if num_tokens <= num_experts:  # decode: few rows per expert
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)


def invoke_fused_moe_kernel(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
                            sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post_pad: torch.Tensor,
                            mul_routed_weight: bool, top_k: int, config: Dict[str, Any]) -> None:
    """c[(token, k)] = a[token // top_k] @ b[expert].T (times the routing weight); a [rows, K], b [E, N, K],
    c viewed as [num_tokens * top_k, N]."""
    num_pairs, n = c.shape
    grid = (triton.cdiv(sorted_ids.shape[0], config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    fused_moe_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_post_pad,
        n, b.shape[2], num_pairs, sorted_ids.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        MUL_ROUTED_WEIGHT=mul_routed_weight, TOP_K=top_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None, **config,
    )


def fused_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", config: Dict | None = None,
                  unsorted_max_tokens: int = 0) -> torch.Tensor:
    """hidden [M, H]; w1 [E, 2I, H] (gate then up); w2 [E, H, I]; topk [M, k] -> a new [M, H] tensor. ``config``:
    the launch's tiles (and num_warps, num_stages), else the tuned or default ones for this M; up to
    ``unsorted_max_tokens`` tokens the pairs are not sorted (``unsorted_blocks``)."""
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w1.shape
    top_k = topk_ids.shape[1]
    config = config or get_moe_config(num_tokens, num_experts, w2.shape[2], hidden_states.dtype)
    if num_tokens <= unsorted_max_tokens:  # one pair per block: the smallest block tl.dot takes
        config = {**config, "BLOCK_M": 16, "GROUP_M": 1}
        sorted_ids, expert_ids, num_post_pad = unsorted_blocks(topk_ids, config["BLOCK_M"])
    else:
        sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, config["BLOCK_M"], num_experts)
    weights = topk_weights.to(torch.float32).contiguous().view(-1)
    gate_up = hidden_states.new_empty(num_tokens * top_k, two_i)
    invoke_fused_moe_kernel(hidden_states, w1, gate_up, weights, sorted_ids, expert_ids, num_post_pad,
                            False, top_k, config)
    if activation == "silu" and gate_up.dtype.itemsize == 2:
        act = silu_and_mul(gate_up)  # one kernel
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[activation](gate) * up
    down = hidden_states.new_empty(num_tokens * top_k, hidden)
    invoke_fused_moe_kernel(act, w2, down, weights, sorted_ids, expert_ids, num_post_pad, True, 1, config)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
