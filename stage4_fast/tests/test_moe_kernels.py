"""MoE: the fused Triton kernel (interpreter on CPU) against the torch reference, the block alignment, and the
router against HF's Qwen3-MoE router."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the [test] extra installs it)")

from stage4_fast.kernel.ref import fused_experts_ref  # noqa: E402
from stage4_fast.kernel.triton_moe import fused_experts, moe_align_block_size  # noqa: E402
from stage4_fast.moe import create_moe_backend, fused_topk  # noqa: E402


def _problem(seed: int, tokens: int, experts: int, hidden: int, inter: int, top_k: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    return x, w1, w2, logits


@pytest.mark.parametrize(
    "tokens,experts,hidden,inter,top_k",
    [(1, 8, 64, 64, 2), (7, 8, 64, 32, 2), (33, 4, 48, 40, 3), (20, 16, 32, 24, 1), (3, 64, 32, 16, 4)],
)
@pytest.mark.parametrize("unsorted_max_tokens", [0, 64], ids=["sorted", "unsorted"])
def test_fused_experts_match_reference(tokens, experts, hidden, inter, top_k, unsorted_max_tokens):
    x, w1, w2, logits = _problem(tokens, tokens, experts, hidden, inter, top_k)
    weights, ids = fused_topk(x, logits, top_k, renormalize=True)
    torch.testing.assert_close(fused_experts(x, w1, w2, weights, ids, unsorted_max_tokens=unsorted_max_tokens),
                               fused_experts_ref(x, w1, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_unsorted_blocks_give_each_pair_a_block_of_its_own():
    from stage4_fast.kernel.triton_moe import unsorted_blocks

    ids = torch.tensor([[3, 1], [1, 0]])
    sorted_ids, expert_ids, num_post_pad = unsorted_blocks(ids, 4)
    assert sorted_ids.tolist() == [0, 4, 4, 4, 1, 4, 4, 4, 2, 4, 4, 4, 3, 4, 4, 4]  # padding = the pair count
    assert expert_ids.tolist() == [3, 1, 1, 0] and num_post_pad.tolist() == [16]


def test_fused_and_torch_backends_agree():
    x, w1, w2, logits = _problem(5, 9, 8, 32, 16, 2)
    names = ("fused", "fused_sorted", "torch")
    outs = [create_moe_backend(name).forward(x, w1, w2, logits, 2, True, "silu", False) for name in names]
    for out in outs[:2]:
        torch.testing.assert_close(out, outs[2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [1, 4, 16])
def test_align_block_size_groups_pairs_by_expert(block):
    gen = torch.Generator().manual_seed(block)
    num_experts, tokens, top_k = 6, 11, 2
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, block, num_experts)
    numel = ids.numel()
    used = int(num_post_pad)
    assert used % block == 0 and sorted_ids.shape[0] == numel + num_experts * (block - 1)
    flat = ids.flatten()
    real = sorted_ids[:used][sorted_ids[:used] < numel]
    assert sorted(real.tolist()) == list(range(numel))  # every (token, k) pair exactly once
    assert (sorted_ids[used:] == numel).all()
    for blk in range(used // block):
        members = sorted_ids[blk * block : (blk + 1) * block]
        members = members[members < numel].long()
        assert (flat[members] == expert_ids[blk]).all()  # a block holds one expert's pairs


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (5, 60, 4), (3, 8, 8), (4, 16, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_kernel_matches_torch_routing(tokens, experts, top_k, renormalize):
    from stage4_fast.kernel.triton_moe import topk_softmax

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts))
    weights, ids = topk_softmax(logits, top_k, renormalize)
    ref_weights, ref_ids = fused_topk(logits, logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)


def test_router_matches_hf_qwen3_moe():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for norm in (True, False):
        config = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
        router = Qwen3MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
        x = torch.randn(10, 32, generator=torch.Generator().manual_seed(1))
        logits, hf_weights, hf_ids = router(x)
        weights, ids = fused_topk(x, logits, 3, renormalize=norm)
        assert torch.equal(ids.long(), hf_ids)
        torch.testing.assert_close(weights, hf_weights.float(), atol=0, rtol=0)


def test_an_explicit_config_with_warps_and_stages_reaches_the_launch():
    """A tuned config carries num_warps / num_stages besides the tiles: the launch takes them (the interpreter
    accepts and ignores them), and the result is the reference's."""
    x, w1, w2, logits = _problem(3, 9, 8, 64, 32, 2)
    weights, ids = fused_topk(x, logits, 2, renormalize=True)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=8, num_stages=4)
    torch.testing.assert_close(fused_experts(x, w1, w2, weights, ids, config=config),
                               fused_experts_ref(x, w1, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.fixture
def moe_config_dir(tmp_path, monkeypatch):
    """A config folder of its own, the GPU name an H100's, the interpreter off (as on a GPU)."""
    from stage4_fast.kernel import triton_moe

    monkeypatch.setattr(triton_moe, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(triton_moe, "triton_interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    triton_moe.tuned_configs.cache_clear()
    yield tmp_path
    triton_moe.tuned_configs.cache_clear()


def test_a_tuned_config_file_gives_the_nearest_token_counts_config(moe_config_dir):
    import json

    from stage4_fast.kernel.triton_moe import get_moe_config

    small = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
             "num_stages": 4}
    large = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16, "num_warps": 8,
             "num_stages": 3}
    # SGLang's name and format: E experts, N = the intermediate size per rank (w2's last dim), the GPU's name
    (moe_config_dir / "E=8,N=64,device_name=NVIDIA_H100_80GB_HBM3.json").write_text(
        json.dumps({"1": small, "256": large}))
    bf16 = torch.bfloat16
    assert get_moe_config(1, 8, 64, bf16) == dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4,
                                                  num_stages=4)
    assert get_moe_config(100, 8, 64, bf16)["BLOCK_M"] == 16  # nearer 1 than 256
    assert get_moe_config(200, 8, 64, bf16)["BLOCK_M"] == 64
    assert get_moe_config(100_000, 8, 64, bf16)["num_warps"] == 8


def test_without_a_tuned_file_the_heuristic_config_stays(moe_config_dir, monkeypatch):
    import json

    from stage4_fast.kernel import triton_moe

    (moe_config_dir / "E=8,N=64,device_name=NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps(
        {"1": {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
               "num_stages": 4}}))
    decode = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1)
    assert triton_moe.get_moe_config(1, 8, 32, torch.bfloat16) == decode  # another N: no file
    assert triton_moe.get_moe_config(1, 16, 64, torch.bfloat16) == decode  # another E
    assert triton_moe.get_moe_config(1, 8, 64, torch.float32) == decode  # tuned in 16-bit only
    assert triton_moe.get_moe_config(100, 8, 64, torch.float32)["BLOCK_M"] == 64
    monkeypatch.setattr(triton_moe, "triton_interpreting", lambda: True)  # the interpreter keeps its small tiles
    assert triton_moe.get_moe_config(1, 8, 64, torch.bfloat16) == dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1)
