"""Qwen3.5 hybrid (gated DeltaNet linear attention + full attention) against HF, fp32 greedy, token for token.

The kernels are checked against the literal recurrence and HF's torch reference; the engine through the scheduler
with batching, chunked prefill at an 8-token budget (the state is carried across chunks), requests finishing at
different times, slot reuse, and the radix cache forced off. The prompts are the shared suite's (their greedy
margins under this model were checked to stay above 1e-2), the CUDA-graph emulation with the state slots in its
fixed buffers, and the server.
"""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import List

import pytest
import torch

from stage4_fast import core, harness, message
from stage4_fast import llm as llm_mod
from stage4_fast.attention import hybrid_linear as hybrid
from stage4_fast.engine import graph as graph_mod
from stage4_fast.kernel import gated_delta as gd

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "tiny-qwen3.5"
NEW_TOKENS = 16


@functools.lru_cache(maxsize=None)
def model_dir() -> Path:
    if not (MODEL / "config.json").exists():  # seeded: building it here gives the checked model
        subprocess.run([sys.executable, "-m", "models", "make", "tiny-qwen3.5"], cwd=REPO, check=True)
    return MODEL


def mixed_prompts(n: int, seed: int, lo: int, hi: int) -> List[List[int]]:
    """The shared suite's prompt generator (same seeds, same prompts)."""
    rng = random.Random(seed)
    shared = [rng.randint(100, 49000) for _ in range(24)]
    out = []
    for i in range(n):
        tail = [rng.randint(100, 49000) for _ in range(rng.randint(lo, hi))]
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


@functools.lru_cache(maxsize=1)
def _hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def _hf_one(prompt: tuple, n: int) -> List[int]:
    with torch.inference_mode():
        out = _hf_model().generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_generate(prompts: List[List[int]], n: int = NEW_TOKENS) -> List[List[int]]:
    return [_hf_one(tuple(p), n) for p in prompts]


def greedy(n: int = NEW_TOKENS) -> object:
    return core.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


def run(prompts: List[List[int]], params=None, **kwargs) -> List[List[int]]:
    kwargs.setdefault("dtype", torch.float32)
    llm = llm_mod.LLM(str(model_dir()), **kwargs)
    results = llm.generate(prompts, params if params is not None else greedy(), use_tqdm=False)
    assert not [r for r in results if "error" in r], results
    return [list(r["token_ids"]) for r in results]


# -- kernels -------------------------------------------------------------------------------------------------------
def _random_inputs(L: int, Hk: int = 2, Hv: int = 4, Dk: int = 16, Dv: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(L, Hk, Dk, generator=gen), torch.randn(L, Hk, Dk, generator=gen)
    v = torch.randn(L, Hv, Dv, generator=gen)
    g = -torch.rand(L, Hv, generator=gen)  # log decay <= 0
    beta = torch.rand(L, Hv, generator=gen)
    state = torch.randn(Hv, Dk, Dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk_size", [64, 5, 1])
def test_chunked_delta_rule_equals_token_by_token_recurrence(chunk_size):
    q, k, v, g, beta, state = _random_inputs(37)
    out, final = gd.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    s, steps = state[None], []
    for t in range(37):
        o, s = gd.recurrent_gated_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                             beta[t : t + 1], s)
        steps.append(o)
    torch.testing.assert_close(out, torch.cat(steps), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, s[0], atol=1e-5, rtol=1e-5)


def test_chunked_delta_rule_carries_state_across_segments():
    q, k, v, g, beta, _ = _random_inputs(50, seed=1)
    whole, whole_state = gd.chunk_gated_delta_rule(q, k, v, g, beta, None)
    outs, state = [], None
    for s, e in [(0, 8), (8, 9), (9, 30), (30, 50)]:  # chunked prefill: the state goes from one piece to the next
        o, state = gd.chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-5, rtol=1e-5)


def test_chunked_delta_rule_matches_hf_reference():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, state = _random_inputs(70, seed=2)
    want, want_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                    initial_state=state[None], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    got, got_state = gd.chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state[0], atol=1e-5, rtol=1e-5)


def test_causal_conv_with_carried_state_equals_one_conv_over_everything():
    gen = torch.Generator().manual_seed(3)
    C, K, L = 6, 4, 30
    w, x = torch.randn(C, K, generator=gen), torch.randn(L, C, generator=gen)
    want = torch.nn.functional.silu(
        torch.nn.functional.conv1d(x.t()[None], w[:, None, :], padding=K - 1, groups=C)[0, :, :L]
    ).t()
    a, state = gd.causal_conv1d_prefill(x[:2], w, None)  # shorter than the kernel: the state keeps zeros
    b, state = gd.causal_conv1d_prefill(x[2:20], w, state)
    steps, s = [], state[None]
    for t in range(20, L):
        o, s = gd.causal_conv1d_update(x[t : t + 1], w, s)
        steps.append(o)
    torch.testing.assert_close(torch.cat([a, b, *steps]), want, atol=1e-6, rtol=1e-6)


# -- engine vs HF --------------------------------------------------------------------------------------------------
def test_batch_of_different_lengths_matches_hf():
    prompts = mixed_prompts(6, seed=7, lo=4, hi=40)
    assert run(prompts) == hf_generate(prompts)


@pytest.mark.parametrize("page_size", [1, 4])
def test_long_and_short_prompts_in_one_batch_match_hf(page_size):
    prompts = mixed_prompts(5, seed=3, lo=4, hi=30)
    assert run(prompts, page_size=page_size, max_extend_tokens=512) == hf_generate(prompts)


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_budget_8_carries_state_and_matches_hf(overlap):
    prompts = mixed_prompts(6, seed=7, lo=4, hi=40)  # up to 64 tokens: up to 8 chunks each
    assert run(prompts, max_extend_tokens=8, overlap_scheduling=overlap, page_size=4) == hf_generate(prompts)


def test_mixed_chunks_continue_the_carried_state_and_match_hf():
    """enable_mixed_chunk: a running request's decode step inside a prefill batch is, to its linear layers, a
    one-token chunk continuing from the carried state; the outputs match HF, and mixed batches did run."""
    prompts = mixed_prompts(6, seed=7, lo=4, hi=40)
    llm = llm_mod.LLM(str(model_dir()), dtype=torch.float32, max_extend_tokens=8, enable_mixed_chunk=True)
    mixed = []
    forward_batch = llm.engine.forward_batch

    def watched(batch, args, before_sampling=None):
        mixed.append(batch.decode_reqs)
        return forward_batch(batch, args, before_sampling)

    llm.engine.forward_batch = watched
    results = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [list(r["token_ids"]) for r in results] == hf_generate(prompts)
    assert max(mixed) > 0


def test_requests_finishing_at_different_times_match_hf():
    """Different max_tokens and 2 request slots: requests leave at different steps, queued ones join a running
    decode batch and reuse the freed slots (whose old state must not leak in), prompts chunked at 8 tokens."""
    prompts = mixed_prompts(6, seed=7, lo=4, hi=40)
    lengths = [3, 16, 1, 9, 16, 5]
    got = run(prompts, [greedy(n) for n in lengths], max_running_req=2, max_extend_tokens=8)
    assert got == [ref[:n] for ref, n in zip(hf_generate(prompts), lengths)]


@pytest.mark.parametrize("abort_at", [1, 4, 9])
def test_abort_frees_the_state_slot_for_the_next_request(abort_at):
    """Request 0 is aborted mid-prefill (chunked) or mid-decode; with 2 slots its slot goes to a queued request,
    which must start from a zero state: every other output equals HF, the aborted one is a prefix of HF's."""
    prompts = mixed_prompts(6, seed=7, lo=4, hi=40)
    llm = llm_mod.LLM(str(model_dir()), dtype=torch.float32, max_running_req=2, max_extend_tokens=8)
    steps, inner = iter(range(10_000)), llm.receive_msg

    def receive_msg(blocking: bool = False):
        msgs = inner(blocking=blocking)
        if next(steps) == abort_at:
            msgs.append(message.AbortBackendMsg(0))
        return msgs

    llm.receive_msg = receive_msg  # type: ignore[method-assign]
    results = llm.generate(prompts, greedy(), use_tqdm=False)
    ref = hf_generate(prompts)
    assert results[0].get("error") == "aborted" and results[0]["token_ids"] == ref[0][: len(results[0]["token_ids"])]
    assert [list(r["token_ids"]) for r in results[1:]] == ref[1:]


def test_second_generate_on_the_same_engine_matches_hf():
    """Slots and pages are reused by a second round; the radix cache asked for is replaced by the naive one."""
    prompts = mixed_prompts(6, seed=7, lo=4, hi=40)
    llm = llm_mod.LLM(str(model_dir()), dtype=torch.float32, cache_type="radix", max_extend_tokens=8)
    assert type(llm.cache_manager.prefix_cache).__name__ == "NaivePrefixCache"
    ref = hf_generate(prompts)
    for order in (prompts, prompts[::-1]):
        results = llm.generate(order, greedy(), use_tqdm=False)
        assert [list(r["token_ids"]) for r in results] == (ref if order is prompts else ref[::-1])


def test_dropping_the_carried_state_changes_the_output(monkeypatch):
    """The chunked-prefill tests are sensitive to the carry: treating every chunk as a fresh request (state
    dropped between chunks) gives different tokens."""
    prompts = mixed_prompts(6, seed=7, lo=4, hi=40)
    original = hybrid.HybridLinearAttnBackend.prepare_metadata

    def forgetful(self, batch):
        original(self, batch)
        for seg in batch.state_metadata.segments or []:
            seg.fresh = True

    monkeypatch.setattr(hybrid.HybridLinearAttnBackend, "prepare_metadata", forgetful)
    assert run(prompts, max_extend_tokens=8) != hf_generate(prompts)


def test_a_prefix_the_state_has_not_seen_is_refused():
    """A request claiming a cached prefix (what a radix hit would do) while its slot's state holds something else."""
    backend = hybrid.HybridLinearAttnBackend.__new__(hybrid.HybridLinearAttnBackend)
    backend._state_len = [0, 0]

    class _Full:
        def prepare_metadata(self, batch):
            pass

    backend.full = _Full()
    backend.device = torch.device("cpu")
    req = core.Req(torch.arange(10, dtype=torch.int32), table_idx=0, cached_len=6, output_len=4, uid=0,
                   sampling_params=greedy())
    batch = core.Batch([req], "prefill")
    batch.padded_reqs = [req]
    with pytest.raises(RuntimeError, match="prefix reuse must be off"):
        backend.prepare_metadata(batch)


def test_triton_decode_step_updates_the_pool_in_place_like_the_reference():
    """The GPU decode kernel (run by the Triton interpreter here: conftest sets TRITON_INTERPRET on CPU)."""
    from stage4_fast.kernel.triton_gated_delta import recurrent_gated_delta_rule_inplace

    gen = torch.Generator().manual_seed(4)
    B, HK, HV, DK, DV = 3, 2, 4, 16, 64
    x = torch.randn(B, 2 * HK * DK + HV * DV, generator=gen)
    g, beta = -torch.rand(B, HV, generator=gen), torch.rand(B, HV, generator=gen)
    pool, slots = torch.randn(6, HV, DK, DV, generator=gen), torch.tensor([4, 1, 2])
    q, k, v = x.split([HK * DK, HK * DK, HV * DV], dim=-1)
    want_o, want_state = gd.recurrent_gated_delta_rule(q.reshape(B, HK, DK), k.reshape(B, HK, DK),
                                                       v.reshape(B, HV, DV), g, beta, pool[slots])
    updated = pool.clone()
    got_o = recurrent_gated_delta_rule_inplace(x, g, beta, updated, slots, HK, DK)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(updated[slots], want_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(updated[[0, 3, 5]], pool[[0, 3, 5]], atol=0, rtol=0)  # other slots untouched


def test_engine_with_the_triton_decode_step_matches_hf(monkeypatch):
    monkeypatch.setattr(hybrid, "TRITON_DECODE", True)
    prompts = mixed_prompts(6, seed=7, lo=4, hi=40)[:3]
    assert run(prompts, max_extend_tokens=8) == hf_generate(prompts)


# -- CUDA graphs (CPU emulation) -----------------------------------------------------------------------------------
@pytest.mark.parametrize("max_bs", [0, 16])
def test_cuda_graph_emulation_on_and_off_match_hf(max_bs):
    prompts = mixed_prompts(5, seed=3, lo=4, hi=30)
    assert run(prompts, cuda_graph_max_bs=max_bs, max_extend_tokens=8) == hf_generate(prompts)


def test_graph_replay_reads_the_state_slots_from_its_buffer(monkeypatch):
    """The captured decode reads each request's state slot from a fixed buffer: a replay that does not copy the
    slots in (here: only the full-attention metadata is refreshed) runs every row on the dummy slot and goes wrong."""
    prompts = mixed_prompts(5, seed=3, lo=4, hi=30)

    def stale_slots(self, batch):
        self.full.prepare_for_replay(batch)

    monkeypatch.setattr(hybrid.HybridLinearAttnBackend, "prepare_for_replay", stale_slots)
    assert graph_mod.EMULATION_MAX_BS >= len(prompts)
    assert run(prompts, max_extend_tokens=8, cuda_graph_max_bs=graph_mod.EMULATION_MAX_BS) != hf_generate(prompts)


# -- server --------------------------------------------------------------------------------------------------------
def test_server_serves_the_hybrid_model():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir())
    prompt = "The capital of France is"
    want = tok.decode(hf_generate([tok(prompt).input_ids])[0])
    with harness.serve(str(model_dir())) as base_url:
        body = json.dumps({"model": str(model_dir()), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert json.loads(resp.read())["choices"][0]["text"] == want


def test_the_prefill_warm_up_leaves_the_tokens_alone():
    """``Engine.warm_up_prefill`` (start-up, on a GPU; here by hand) through the hybrid's layers: its dummy prefill
    steps, of one request and of several, run the linear attention on the padding request's state slot, and the
    requests after them get HF's tokens."""
    prompts = [[1, 2, 3, 4, 5], [7] * 30]
    llm = llm_mod.LLM(str(model_dir()), dtype=torch.float32)
    try:
        llm.engine.warm_up_prefill(64)
        llm.engine.warm_up_prefill(64, 4)
        results = llm.generate(prompts, greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(r["token_ids"]) for r in results] == hf_generate(prompts)
