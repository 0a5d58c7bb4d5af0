"""The stage-4 engine through the scheduler (`LLM`): every attention backend and the fused MoE give HF's tokens,
chunked prefill (cached prefixes) included; the CUDA-graph emulation enforces the fixed-buffer discipline."""

from __future__ import annotations

import pytest
import torch

from stage4_fast.core import Batch, Req, SamplingParams
from stage4_fast.engine import graph as graph_module

from .conftest import make_engine, prepared_model
from .fast_helpers import hf_generate, llm_generate
from .helpers import make_llm


@pytest.fixture(scope="module")
def qwen3():
    return prepared_model("tiny-qwen3")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("backend", ["fi", "fa", "fa,fi"])
def test_library_backends_match_hf_through_fakes(qwen3, backend, page_size, fake_flashinfer, fake_flash_attn):
    # an 8-token prefill budget splits the longer prompts: later chunks attend over a cached prefix
    out = llm_generate(qwen3, attention_backend=backend, page_size=page_size, max_extend_tokens=8,
                       cuda_graph_max_bs=graph_module.EMULATION_MAX_BS)
    assert out == hf_generate(qwen3)
    if "fi" in backend:  # decode ran through the CUDA-graph wrapper (the emulation, asked for above)
        assert any(kind == "decode" and args["cuda_graph"] for kind, args in fake_flashinfer.calls)
    if "fa" in backend:
        assert any(call["page_size"] == page_size for call in fake_flash_attn.calls)


def test_triton_backend_matches_hf(qwen3):
    pytest.importorskip("triton", reason="the Triton backend needs the triton package")
    # graphs for batch sizes 1, 2, 4 only: every capture runs a forward, which the interpreter makes slow
    out = llm_generate(qwen3, attention_backend="triton", page_size=4, max_extend_tokens=8, cuda_graph_max_bs=4)
    assert out == hf_generate(qwen3)


def _triton_prefill_graph_run(qwen3) -> list:
    """The tiny model's prompts in 8-token prefill steps (chunks of several requests, some after a cached prefix)
    with the 8-token prefill forward captured (the emulation)."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package")
    return llm_generate(qwen3, attention_backend="triton", page_size=4, max_extend_tokens=8, cuda_graph_max_bs=4,
                        prefill_cuda_graph=True)


def test_full_prefill_steps_replay_the_prefill_graph_and_match_hf(qwen3, monkeypatch):
    from stage4_fast.engine.prefill_graph import PrefillGraphRunner

    replayed: list[int] = []
    replay = PrefillGraphRunner.replay
    monkeypatch.setattr(PrefillGraphRunner, "replay", lambda self, batch: replayed.append(batch.size)
                        or replay(self, batch))
    assert _triton_prefill_graph_run(qwen3) == hf_generate(qwen3)
    assert len(replayed) >= 4 and max(replayed) > 1  # 38 prompt tokens: four full steps, one of several requests


def test_the_prefill_warm_up_of_several_requests_replays_the_prefill_graph_and_changes_no_token(qwen3, monkeypatch):
    """The start-up warm-up at the captured step size (``Engine.warm_up_prefill``, here by hand) goes through the
    graph's replay with several requests, as a burst's first full step does; the requests after it get HF's
    tokens."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package")
    from stage4_fast.engine.prefill_graph import PrefillGraphRunner

    from .fast_helpers import PROMPTS
    from .helpers import greedy

    replayed: list[int] = []
    replay = PrefillGraphRunner.replay
    monkeypatch.setattr(PrefillGraphRunner, "replay", lambda self, batch: replayed.append(batch.size)
                        or replay(self, batch))
    llm = make_llm(qwen3, attention_backend="triton", page_size=4, max_extend_tokens=8, cuda_graph_max_bs=4,
                   prefill_cuda_graph=True)
    try:
        llm.engine.warm_up_prefill(8, 3)
        assert replayed == [3]
        out = [r["token_ids"] for r in llm.generate(list(PROMPTS), greedy(8), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert out == hf_generate(qwen3, n=8)


def test_prefill_graph_sizes_are_every_eighth_of_the_step_then_halves():
    from stage4_fast.engine.prefill_graph import prefill_graph_sizes

    assert prefill_graph_sizes(8192) == [8192, 7168, 6144, 5120, 4096, 3072, 2048, 1024, 512, 256]
    assert prefill_graph_sizes(16384)[-5:] == [4096, 2048, 1024, 512, 256]
    assert prefill_graph_sizes(300) == [300, 262]
    assert prefill_graph_sizes(8) == [8]  # no larger than the smallest size: the step's size alone


def _bare_prefill_runner(sizes: list, max_reqs: int):
    """A PrefillGraphRunner with nothing captured: enough for ``pad_batch``."""
    from stage4_fast.engine.prefill_graph import PrefillGraphRunner

    runner = object.__new__(PrefillGraphRunner)
    runner.sizes, runner.max_reqs, runner._pad_reqs = sizes, max_reqs, {}
    runner.dummy_req = Req(input_ids=torch.zeros(1, dtype=torch.int32), table_idx=7, cached_len=0, output_len=1,
                           uid=-1, sampling_params=SamplingParams())
    return runner


def _prefill_batch(lens: list) -> Batch:
    reqs = [Req(input_ids=torch.zeros(n, dtype=torch.int32), table_idx=i, cached_len=0, output_len=4, uid=i,
                sampling_params=SamplingParams()) for i, n in enumerate(lens)]
    return Batch(reqs=reqs, phase="prefill")


@pytest.mark.parametrize("lens, sizes, max_reqs, padding", [
    ([3, 2], [8, 4], 8, [3]),  # 5 tokens: up to 8
    ([1, 2], [8, 4], 8, [1]),  # 3 tokens: the smallest size that holds them, 4
    ([300, 300], [1024, 512], 8, [256, 168]),  # 424 tokens of padding: prompts of at most 256
    ([4, 4], [8, 4], 8, []),  # a full step: nothing to pad
    ([5, 4], [8, 4], 8, []),  # more tokens than the largest size (not a step the scheduler makes)
    ([3, 2], [8, 4], 2, []),  # the capture's buffers hold 2 requests: eager
    ([3, 2], [8, 4], 3, [3]),  # ... 3: one for the padding
])
def test_a_prefill_batch_is_padded_with_short_dummy_prompts_up_to_the_next_captured_size(lens, sizes, max_reqs,
                                                                                            padding):
    runner = _bare_prefill_runner(sizes, max_reqs)
    batch = _prefill_batch(lens)
    runner.pad_batch(batch)
    assert batch.padded_reqs[: len(lens)] == batch.reqs  # the batch's own requests first: the LM head's rows
    pads = batch.padded_reqs[len(lens):]
    assert [r.extend_len for r in pads] == padding
    assert all(r.table_idx == 7 and r.cached_len == 0 for r in pads)  # the padding row, from its first position


def test_partial_prefill_steps_are_padded_to_a_captured_size_and_match_hf(qwen3, monkeypatch):
    """Prefill graphs at 8 and 7 tokens: every prefill step replays one of them, the last, shorter one padded, and
    the tokens are HF's."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package")
    from stage4_fast.engine import engine as engine_module
    from stage4_fast.engine.prefill_graph import PrefillGraphRunner

    monkeypatch.setattr(engine_module, "prefill_graph_sizes", lambda num_tokens: [num_tokens, num_tokens - 1])
    replayed: list[tuple[int, int]] = []
    replay = PrefillGraphRunner.replay
    monkeypatch.setattr(PrefillGraphRunner, "replay", lambda self, batch: replayed.append(
        (batch.input_ids.shape[0], batch.padded_size - batch.size)) or replay(self, batch))
    eager_prefills: list[int] = []
    forward = engine_module.Engine.forward_logits

    def forward_logits(self, batch):
        if batch.is_prefill and not self.prefill_graph.can_replay(batch):
            eager_prefills.append(batch.input_ids.shape[0])
        return forward(self, batch)

    monkeypatch.setattr(engine_module.Engine, "forward_logits", forward_logits)
    assert _triton_prefill_graph_run(qwen3) == hf_generate(qwen3)
    assert eager_prefills == []
    # 38 prompt tokens: four full steps, then 6 tokens padded to 7
    assert replayed == [(8, 0)] * 4 + [(7, 1)]


def test_prefill_graph_emulation_catches_inputs_or_metadata_not_copied_into_its_buffers(qwen3, monkeypatch):
    from stage4_fast.attention.triton import TritonBackend
    from stage4_fast.engine.prefill_graph import PrefillCaptureBuffer

    expected = hf_generate(qwen3)
    with monkeypatch.context() as patch:
        patch.setattr(PrefillCaptureBuffer, "copy_from", lambda self, batch: self.out_loc.copy_(batch.out_loc))
        assert _triton_prefill_graph_run(qwen3) != expected
    with monkeypatch.context() as patch:  # (the capture copies its own metadata in by itself)
        patch.setattr(TritonBackend, "prepare_for_prefill_replay", lambda self, batch: None)
        assert _triton_prefill_graph_run(qwen3) != expected


@pytest.mark.parametrize("model, config, why", [
    ("tiny-qwen3", dict(attention_backend="torch"), "not Triton's"),
    ("tiny-qwen3", dict(attention_backend="triton", cuda_graph_max_bs=0), "CUDA graphs are off"),
    ("tiny-qwen3", dict(attention_backend="triton", prefill_cuda_graph=False), "prefill graphs are off"),
    ("tiny-qwen3-moe", dict(attention_backend="triton"), "MoE"),
])
def test_the_prefill_graph_is_captured_only_where_a_launch_depends_on_the_token_count_alone(model, config, why,
                                                                                            caplog):
    pytest.importorskip("triton", reason="the Triton backend needs the triton package")
    engine = make_engine(prepared_model(model), **{"cuda_graph_max_bs": 1, "prefill_cuda_graph": True, **config})
    try:
        with caplog.at_level("INFO", logger="stage4_fast.engine.engine"):
            engine.capture_prefill_graph(8)
        assert engine.prefill_graph is None and why in caplog.text
    finally:
        engine.shutdown()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the Triton interpreter warns on inf - inf
@pytest.mark.parametrize("backend", ["torch", "triton", "fi", "fa"])
def test_graph_capture_reads_no_unwritten_kv(qwen3, backend, monkeypatch, fake_flashinfer, fake_flash_attn):
    """Capturing runs a forward of the dummy request before any request was served. It must read only the zeroed
    dummy page: the capture buffers once pointed at page-table row 0 (slot 0, not written yet), so on a CPU the
    capture read whatever the allocator left there (NaN/inf in padded rows; a rare interpreter warning in CI).
    Every float tensor made with torch.empty starts as NaN here, so any such read shows in the captured logits."""
    if backend == "triton":
        pytest.importorskip("triton", reason="the Triton backend needs the triton package")
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    engine = make_engine(qwen3, attention_backend=backend, page_size=4, cuda_graph_max_bs=4)
    try:
        assert engine.graph_runner.graph_map, "no graph was captured"
        assert torch.isfinite(engine.graph_runner.buffer.logits).all()
    finally:
        engine.shutdown()


def test_graph_lm_head_writes_into_the_logits_buffer(qwen3, monkeypatch):
    """A captured decode forward leaves its logits in the runner's buffer with no copy: the LM head writes them there
    (a copy from a temporary was a 68 MB memcpy per replay on the GPU at batch 223)."""
    copies = []
    real_setitem = torch.Tensor.__setitem__

    def counting_setitem(self, key, value):
        copies.append(tuple(self.shape))
        return real_setitem(self, key, value)

    engine = make_engine(qwen3, page_size=4, cuda_graph_max_bs=4)
    try:
        runner = engine.graph_runner
        monkeypatch.setattr(torch.Tensor, "__setitem__", counting_setitem)
        for bs in runner.graph_bs_list:
            runner.graph_map[bs].replay()
        assert not [shape for shape in copies if shape == tuple(runner.buffer.logits.shape)]
    finally:
        engine.shutdown()
    assert llm_generate(qwen3, cuda_graph_max_bs=graph_module.EMULATION_MAX_BS) == hf_generate(qwen3)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-qwen3-moe-dense"])
def test_fused_moe_backend_matches_hf(model):
    pytest.importorskip("triton", reason="the fused MoE kernel needs the triton package")
    moe = prepared_model(model)
    prompts = [[1, 2, 3, 4, 5], [9, 8]]
    assert llm_generate(moe, prompts, 4, moe_backend="fused", cuda_graph_max_bs=2) == hf_generate(moe, prompts, 4)


def test_an_all_greedy_graph_batch_takes_its_tokens_from_the_graph(qwen3, monkeypatch):
    """Every captured graph ends in the argmax of its logits. A greedy decode batch takes its tokens from there (so
    a wrong graph output shows in its tokens); a batch whose logits are processed first (a logit bias) samples from
    the processed logits and ignores it."""
    def zeros(self, batch):
        return torch.zeros(batch.size, dtype=torch.int32)

    monkeypatch.setattr(graph_module.GraphRunner, "greedy_tokens", zeros)
    outputs = llm_generate(qwen3, cuda_graph_max_bs=graph_module.EMULATION_MAX_BS)
    assert all(out[1:] == [0] * (len(out) - 1) for out in outputs)  # the first token comes from the prefill
    assert outputs != hf_generate(qwen3)
    llm = make_llm(qwen3, cuda_graph_max_bs=graph_module.EMULATION_MAX_BS)
    try:
        biased = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=[(7, 1e4)])
        assert llm.generate([[1, 2, 3]], biased, use_tqdm=False)[0]["token_ids"] == [7] * 6
    finally:
        llm.shutdown()


def test_graph_emulation_catches_an_input_not_copied_into_its_buffer(qwen3, monkeypatch):
    expected = hf_generate(qwen3)

    def copy_all_but_input_ids(self, batch):
        bs = batch.padded_size
        self.out_loc[:bs].copy_(batch.out_loc)
        self.positions[:bs].copy_(batch.positions)

    monkeypatch.setattr(graph_module.GraphCaptureBuffer, "copy_from", copy_all_but_input_ids)
    assert llm_generate(qwen3, cuda_graph_max_bs=graph_module.EMULATION_MAX_BS) != expected
    assert llm_generate(qwen3, cuda_graph_max_bs=0) == expected  # eager decode does not use the buffers


def test_graph_emulation_catches_metadata_not_copied_into_its_buffer(qwen3, monkeypatch):
    from stage4_fast.attention.torch_backend import TorchBackend

    monkeypatch.setattr(TorchBackend, "prepare_for_replay", lambda self, batch: None)
    assert llm_generate(qwen3, cuda_graph_max_bs=graph_module.EMULATION_MAX_BS) != hf_generate(qwen3)


def test_decode_batches_are_padded_to_captured_sizes():
    dummy = Req(torch.zeros(1, dtype=torch.int32), 8, 0, 1, -1, SamplingParams())
    runner = graph_module.GraphRunner.__new__(graph_module.GraphRunner)  # no model needed for the policy
    runner.graph_bs_list, runner.max_graph_bs, runner.dummy_req = [1, 2, 4, 8], 8, dummy
    reqs = [object() for _ in range(5)]
    batch = Batch(reqs, "decode")  # type: ignore[arg-type]
    runner.pad_batch(batch)
    assert batch.padded_reqs[:5] == reqs and batch.padded_reqs[5:] == [dummy] * 3
    big = Batch([object() for _ in range(9)], "decode")  # type: ignore[arg-type]
    runner.pad_batch(big)
    assert big.padded_size == 9 and not runner.can_use_cuda_graph(big)
    prefill = Batch(reqs, "prefill")  # type: ignore[arg-type]
    runner.pad_batch(prefill)
    assert prefill.padded_reqs == reqs


def test_default_graph_sizes():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert graph_module.default_graph_bs_list(cpu, 0, None, None) == []  # CPU: eager unless asked
    assert graph_module.default_graph_bs_list(cpu, 0, None, 16) == [1, 2, 4, 8, 16]
    assert graph_module.default_graph_bs_list(cpu, 0, None, 0) == []
    assert graph_module.default_graph_bs_list(cpu, 0, [8, 2, 2], None) == [2, 8]
    sizes = graph_module.default_graph_bs_list(gpu, 100 << 30, None, None)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and len(sizes) == 35
    assert graph_module.default_graph_bs_list(gpu, 78 << 30, None, None)[-1] == 256  # an empty 80 GB H100
    assert graph_module.default_graph_bs_list(gpu, 40 << 30, None, None)[-1] == 160


def test_serve_reports_the_cpu_defaults(qwen3):
    from stage4_fast.serve import describe
    from stage4_fast.server import parse_args

    config, _ = parse_args(["--model", str(qwen3), "--tp", "2"])
    text = describe(config)
    for part in ("on cpu", "tp 2", "attention torch", "no graphs", "KV cache float32"):
        assert part in text
    config, _ = parse_args(["--model", str(qwen3), "--kv-cache-dtype", "fp8_e5m2"])
    assert "KV cache fp8_e5m2" in describe(config) and "API server" not in describe(config)
    config, _ = parse_args(["--model", str(qwen3), "--api-server-count", "2", "--port", "8000"])
    assert describe(config).endswith("http://127.0.0.1:8000 (2 API server processes)")


@pytest.mark.parametrize("page_size,num_reqs", [(1, 1), (4, 1), (1, 5), (4, 5)])
def test_the_prefill_warm_up_writes_only_the_padding_slot_and_changes_no_token(qwen3, page_size, num_reqs):
    """``Engine.warm_up_prefill`` (run at start-up on a GPU, here by hand): a prefill step of dummy tokens, of one
    request or several, through the real forward, LM head and sampler, whose KV goes to the dummy request's padding
    page only — every other slot of the pool keeps its bytes, and the requests after it get HF's tokens."""
    from .fast_helpers import PROMPTS
    from .helpers import greedy

    llm = make_llm(qwen3, page_size=page_size, max_running_req=8)
    try:
        engine = llm.engine
        pool = engine.kv_cache
        padding = slice(engine.num_pages * page_size, (engine.num_pages + 1) * page_size)

        def slots(i: int) -> torch.Tensor:  # the layer's K bytes by token slot, whatever the page size (bytes: the
            k = pool.k_cache(i)               # pool starts uninitialised, and a NaN there equals nothing)
            return k.reshape(-1, k.shape[-2], k.shape[-1]).view(torch.uint8)

        before = [slots(i).clone() for i in range(pool.num_layers)]
        engine.warm_up_prefill(40, num_reqs)
        for i, old in enumerate(before):
            new = slots(i)
            assert torch.equal(new[: padding.start], old[: padding.start])
            assert not torch.equal(new[padding], old[padding])  # it ran: the padding slot was written
        out = [r["token_ids"] for r in llm.generate(list(PROMPTS), greedy(8), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert out == hf_generate(qwen3, n=8)


def test_the_scheduler_warms_up_a_step_of_several_requests_at_start_up_and_changes_no_token(qwen3, monkeypatch):
    """What the scheduler runs at start-up on a GPU (here with the GPU check forced on): the prefill warm-up of
    ``max_extend_tokens`` over WARM_UP_PREFILL_REQS requests, and its scatter into the padding row of the token pool,
    which stays zeros; the requests after it get HF's tokens."""
    from stage4_fast.engine.engine import Engine
    from stage4_fast.scheduler import scheduler as scheduler_module

    from .fast_helpers import PROMPTS
    from .helpers import greedy

    calls: list[tuple[int, int]] = []
    warm_up = Engine.warm_up_prefill
    monkeypatch.setattr(Engine, "warm_up_prefill", lambda self, tokens, reqs=1: calls.append((tokens, reqs))
                        or warm_up(self, tokens, reqs))
    monkeypatch.setattr(scheduler_module, "is_cuda", lambda device: True)
    llm = make_llm(qwen3, max_running_req=8, max_extend_tokens=48)
    try:
        assert calls == [(48, scheduler_module.WARM_UP_PREFILL_REQS)]
        padding_row = llm.token_pool[llm.engine.dummy_req.table_idx]
        assert not padding_row.any()
        out = [r["token_ids"] for r in llm.generate(list(PROMPTS), greedy(8), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert out == hf_generate(qwen3, n=8)


def test_the_gemm_warm_up_runs_every_projection_at_each_row_count_and_changes_no_token(qwen3, monkeypatch):
    """``Engine.warm_up_gemms`` (run at start-up on a GPU, here by hand): every distinct projection at each row
    count of the grid (all below the step, then every step rows, and the largest), the LM head at every request
    count up to max_running_req; the requests after it get HF's tokens."""
    import torch.nn.functional as F

    from stage4_fast.engine import engine as engine_module

    from .fast_helpers import PROMPTS
    from .helpers import greedy

    seen: set[tuple[int, tuple[int, ...]]] = set()
    added: set[tuple[int, tuple[int, ...]]] = set()  # the o and down GEMMs that add into the residual
    plain_linear, plain_addmm_ = F.linear, torch.Tensor.addmm_

    def recording_linear(x, weight, bias=None):
        seen.add((x.shape[0], tuple(weight.shape)))
        return plain_linear(x, weight, bias)

    def recording_addmm_(residual, x, weight_t):
        added.add((x.shape[0], tuple(weight_t.t().shape)))
        return plain_addmm_(residual, x, weight_t)

    llm = make_llm(qwen3, max_running_req=8)
    try:
        layer = llm.engine.model.model.layers.op_list[0]
        projections = {tuple(p.weight.shape) for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                       layer.mlp.gate_up_proj, layer.mlp.down_proj)}
        row_parallel = {tuple(p.weight.shape) for p in (layer.self_attn.o_proj, layer.mlp.down_proj)}
        with monkeypatch.context() as m:
            m.setattr(F, "linear", recording_linear)
            m.setattr(torch.Tensor, "addmm_", recording_addmm_)
            llm.engine.warm_up_gemms(40, step=16)
            first = set(seen)
            seen.clear()
            m.setattr(engine_module, "GEMM_WARM_UP_COUNTS", 2)  # at most two steps: the step doubles to 32
            llm.engine.warm_up_gemms(64, step=16)
        out = [r["token_ids"] for r in llm.generate(list(PROMPTS), greedy(8), use_tqdm=False)]
    finally:
        llm.shutdown()
    rows = [*range(1, 16), 16, 32, 40]
    assert all((r, shape) in first for r in rows for shape in projections)
    assert all((r, shape) in added for r in rows for shape in row_parallel)
    assert {n for n, shape in first if shape not in projections} == set(range(1, 9))  # the LM head's
    assert {n for n, shape in seen if shape in projections} == {*range(1, 32), 32, 64}
    assert out == hf_generate(qwen3, n=8)


def test_a_gemm_warm_up_that_runs_out_of_memory_warns_and_the_engine_still_serves(qwen3, monkeypatch, caplog):
    """A GEMM warm-up that does not fit is skipped with a warning (it runs no collective, so under TP too)."""
    from stage4_fast.engine import engine as engine_module

    from .fast_helpers import PROMPTS
    from .helpers import greedy

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    llm = make_llm(qwen3, max_running_req=8)
    try:
        with monkeypatch.context() as m:
            m.setattr(engine_module, "warm_up_gemms", out_of_memory)
            llm.engine.warm_up_gemms(64)
        assert "GEMM warm-up of 64 rows ran out of GPU memory" in caplog.text
        out = [r["token_ids"] for r in llm.generate(list(PROMPTS), greedy(8), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert out == hf_generate(qwen3, n=8)


def test_a_warm_up_that_runs_out_of_memory_warns_and_the_engine_still_serves(qwen3, monkeypatch, caplog):
    """A warm-up prefill that does not fit says which setting to lower, and start-up goes on: the requests after
    it get HF's tokens. Under TP it raises instead: another rank may be inside the forward's collectives."""
    from dataclasses import replace

    from stage4_fast.distributed import DistributedInfo

    from .fast_helpers import PROMPTS
    from .helpers import greedy

    llm = make_llm(qwen3, max_running_req=8)
    try:
        def out_of_memory():
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        with monkeypatch.context() as m:
            m.setattr(llm.engine.model, "forward", out_of_memory)
            llm.engine.warm_up_prefill(64)
            assert "ran out of GPU memory at start-up" in caplog.text and "--max-num-batched-tokens" in caplog.text
            config = llm.engine.config
            m.setattr(llm.engine, "config", replace(config, tp_info=DistributedInfo(0, 2)))
            with pytest.raises(torch.OutOfMemoryError):
                llm.engine.warm_up_prefill(64)
        out = [r["token_ids"] for r in llm.generate(list(PROMPTS), greedy(8), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert out == hf_generate(qwen3, n=8)


def test_the_prefill_warm_up_leaves_the_moe_models_tokens_alone():
    """The warm-up through Qwen3-MoE's routed experts (one request and several): the requests after it get HF's
    tokens."""
    from .helpers import greedy

    moe = prepared_model("tiny-qwen3-moe")
    prompts = [[1, 2, 3, 4, 5], [9, 8]]
    llm = make_llm(moe, max_running_req=8)
    try:
        llm.engine.warm_up_prefill(64)
        llm.engine.warm_up_prefill(64, 4)
        out = [r["token_ids"] for r in llm.generate(prompts, greedy(4), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert out == hf_generate(moe, prompts, 4)
