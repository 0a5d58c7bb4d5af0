"""The `shapes` ablation group's floor model and rows, the planner's choice of it, and `python -m bench moe-tune`'s
sweep (a fake timer: the real one needs a GPU) and the file it writes, read back as the kernel reads it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import moe_tune, run, shapes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    from models.random_models import make_random_model

    return make_random_model("tiny-qwen3-moe", out=tmp_path_factory.mktemp("m") / "tiny-qwen3-moe")


def test_distinct_experts_under_uniform_routing():
    assert shapes.distinct_experts(128, 8, 1) == pytest.approx(8)
    assert shapes.distinct_experts(128, 8, 2) == pytest.approx(8 + 8 * 120 / 128)  # the second misses the first's
    assert shapes.distinct_experts(128, 8, 10_000) == pytest.approx(128)
    assert shapes.distinct_experts(0, 0, 5) == 0  # a dense model


def test_model_bytes_split_the_checkpoint(tiny_moe):
    """Dense + the whole embedding table + every expert of every layer = every tensor of the checkpoint."""
    from safetensors import safe_open

    cfg = json.loads((tiny_moe / "config.json").read_text())
    mb = shapes.model_bytes(tiny_moe)
    total = 0
    for f in tiny_moe.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            total += sum(st.get_tensor(k).nbytes for k in st.keys())
    embed_table = cfg["vocab_size"] * mb["embed_row"]
    assert mb["dense"] + embed_table + sum(mb["expert"]) * shapes.num_experts(cfg) == total
    assert mb["embed_row"] == cfg["hidden_size"] * 4  # fp32 tiny model: one row
    assert (mb["experts"], mb["top_k"], len(mb["expert"])) == (8, 2, 2)
    assert mb["kv_per_token"] == 2 * 2 * 2 * 32 * 2  # K and V, 2 layers, 2 KV heads of 32, bf16
    # one token reads the dense weights, its embedding row, its top-2 experts per layer and its context's KV
    assert shapes.step_bytes(mb, 1, 10) == mb["dense"] + mb["embed_row"] + 2 * sum(mb["expert"]) + 10 * 512


def test_floors_sum_the_decode_steps():
    mb = {"dense": 1000, "embed_row": 10, "expert": [], "experts": 0, "top_k": 0, "kv_per_token": 1}
    # one stream, 32-token prompt, 4 tokens: steps 1..3 attend to 33, 34, 35 tokens
    assert shapes.decode_floor(mb, 32, 4) == 3 * 1010 + 33 + 34 + 35
    # two requests (prompts 5 and 7, outputs 3 and 2): step 1 both (6 + 8 tokens), step 2 only the first (7)
    assert shapes.offline_floor(mb, [5, 7], [3, 2]) == (1000 + 20 + 14) + (1000 + 10 + 7)


def test_shape_rows_report_the_rate_its_floor_and_the_share():
    r = {"copy_bytes_per_s": 3.0e12, "decode_step_bytes_1": 2.5e9, "offline_floor_tok_s": 40_000.0,
         "decode_floor_tok_s": 1_000.0, "offline": {"tok_s": 10_000.0, "workload": "256 reqs"},
         "decode": {"tok_s": 750.0}}
    results = {"jobs": {"abl:shapes:qwen3-8b-shape": {"stage": "stage4_fast", "result": {"tasks": {"shape": r}}},
                        "abl:shapes:broken": {"stage": "stage4_fast", "error": "boom\nout of memory"}}}
    out: list[dict] = []

    def fail(name: str, *keys: str) -> bool:
        errs = [results["jobs"][k].get("error") for k in keys if results["jobs"][k].get("error")]
        if errs:
            out.append({"name": name, "effect": "error"})
        return bool(errs)

    shapes.shape_rows(results, out, fail)
    rows = {row["name"]: row for row in out}
    assert rows["shape qwen3-8b-shape: offline"]["effect"] == "25% of floor"
    decode = rows["shape qwen3-8b-shape: decode"]
    assert decode["effect"] == "75% of floor"
    assert "floor 1,000 tok/s (copy rate 3,000 GB/s; one-token step 2.50 GB)" in decode["on"]
    assert rows["shape broken"]["effect"] == "error"


def test_the_shapes_group_runs_only_when_named(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}))
    base = dict(gpu=True, quick=False, no_serve=True, ablation_stage=None, no_ablations=False, model=model)
    jobs, _, _ = run.plan(["stage4_fast"], argparse.Namespace(**base, ablations=None), 1)
    assert not any(j.key.startswith("abl:shapes:") for j in jobs)
    jobs, _, _ = run.plan(["stage4_fast"], argparse.Namespace(**base, ablations=["shapes"]), 1)
    shape_jobs = {j.key: j for j in jobs if j.key.startswith("abl:")}
    moe = f"qwen3-30b-a3b-shape-{shapes.MOE_LAYERS}l"
    assert set(shape_jobs) == {"abl:shapes:qwen3-8b-shape", f"abl:shapes:{moe}", f"abl:shapes:{moe}, fused_sorted"}
    assert shape_jobs[f"abl:shapes:{moe}, fused_sorted"].options == {"moe_backend": "fused_sorted"}
    assert all(j.tasks == ["shape"] and j.model == REPO / "models" / j.key.split(":")[2].split(",")[0]
               for j in shape_jobs.values())
    assert shapes.make_command(f"qwen3-30b-a3b-shape-{shapes.MOE_LAYERS}l")[3:] == [
        "qwen3-30b-a3b-shape", "--device", "cuda", "--layers", str(shapes.MOE_LAYERS)]


def test_the_tuning_space_fits_the_rows_each_expert_gets():
    for m in moe_tune.BUCKETS:
        space = moe_tune.candidates(m, 128, 8)
        assert space and len(space) <= 32
        rows = m * 8 / 128
        assert all(c["BLOCK_SIZE_M"] <= max(16, 2 * rows) for c in space), m  # no block mostly padding
    distinct = {json.dumps(c, sort_keys=True) for m in moe_tune.BUCKETS for c in moe_tune.candidates(m, 128, 8)}
    assert len(distinct) <= 60  # each compiles twice (one per GEMM): the sweep's minutes are mostly compiles


def test_the_sweep_keeps_the_fastest_config_and_the_kernel_reads_its_file(tmp_path, monkeypatch):
    space = [{"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4,
              "num_stages": 3} for n in (32, 64, 128)]

    def timer(m: int, config: dict) -> float:
        if config["BLOCK_SIZE_N"] == 128 and m == 4:
            raise RuntimeError("out of resources: shared memory")  # skipped, the sweep goes on
        return abs(config["BLOCK_SIZE_N"] - (32 if m < 4 else 128)) + 1.0

    logs: list[str] = []
    best = moe_tune.sweep((1, 4, 64), lambda m: space, timer, log=logs.append)
    assert [best[k]["BLOCK_SIZE_N"] for k in ("1", "4", "64")] == [32, 64, 128]
    assert any("skipped" in line for line in logs)
    assert moe_tune.sweep((1, 4), lambda m: space, timer, budget_s=-1, log=logs.append) == {}  # budget spent

    from stage4_fast.kernel import triton_moe

    path = moe_tune.config_path(tmp_path, 8, 64, "NVIDIA H100 80GB HBM3")
    assert path.name == "E=8,N=64,device_name=NVIDIA_H100_80GB_HBM3.json"
    path.write_text(json.dumps(best))
    monkeypatch.setattr(triton_moe, "CONFIG_DIR", tmp_path)
    triton_moe.tuned_configs.cache_clear()
    try:
        tuned = triton_moe.tuned_configs(8, 64, "NVIDIA_H100_80GB_HBM3")
    finally:
        triton_moe.tuned_configs.cache_clear()
    assert tuned[64] == moe_tune.kernel_config(best["64"]) == dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, GROUP_M=1,
                                                                      num_warps=4, num_stages=3)


def test_the_tuner_reads_the_shape_from_a_model(tiny_moe):
    args = argparse.Namespace(model=str(tiny_moe), tp=2, experts=None, n=None, hidden=None, top_k=None)
    assert moe_tune.shape_of(args) == (8, 32, 64, 2)  # N: moe_intermediate_size 64 over 2 ranks
    with pytest.raises(SystemExit):
        moe_tune.shape_of(argparse.Namespace(model=None, tp=1, experts=128, n=768, hidden=None, top_k=8))


def test_the_shape_task_measures_and_floors_each_part(tiny_moe, monkeypatch):
    """The worker's `shape` task end to end on the CPU (the copy rate, GPU-only, stubbed): the rate is taken before
    the engine loads, then offline and decode (8 tokens here, 1,024 on a GPU), each with a floor above zero."""
    from bench import worker

    order: list[str] = []
    monkeypatch.setattr(shapes, "DECODE_LEN", 8)
    monkeypatch.setattr(shapes, "copy_rate", lambda: order.append("copy") or 1e9)
    load = worker.load_adapter
    monkeypatch.setattr(worker, "load_adapter", lambda *a, **k: order.append("load") or load(*a, **k))
    args = argparse.Namespace(task="shape", stage="stage4_fast", model=str(tiny_moe), options="{}", quick=True,
                              gpu=False, log=None, http_client="aiohttp", cold_connections=False)
    r = worker.run(args)["tasks"]["shape"]
    assert order == ["copy", "load"]
    assert r["decode"]["new_tokens"] == 8 and r["offline"]["wrong_lengths"] == 0
    assert r["offline_floor_tok_s"] > 0 and r["decode_floor_tok_s"] > 0 and r["copy_bytes_per_s"] == 1e9


def test_kernels_are_charged_end_to_end_and_the_splits_read_as_text():
    """Under PDL a kernel starts while the one before runs: charged from that one's end, the kinds add up to the
    span (8 + 2 + 5 us over 2 steps here, 1 us idle); the rows then say where a step's time went."""
    import types

    import torch

    from bench import profiles

    def kernel(name: str, start: float, end: float):
        return types.SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                                     time_range=types.SimpleNamespace(start=start, end=end))

    cpu_op = types.SimpleNamespace(name="aten::mm", device_type=torch.autograd.DeviceType.CPU,
                                   time_range=types.SimpleNamespace(start=0.0, end=100.0))
    events = [kernel("_gemv_kernel", 0.0, 8.0), kernel("fused_moe_kernel", 5.0, 10.0), cpu_op,
              kernel("_decode_split_kernel", 11.0, 16.0)]
    charged, idle = profiles.serial_by_kind(types.SimpleNamespace(events=lambda: events), steps=2)
    assert charged == {"gemm": 4.0, "moe": 1.0, "attention": 2.5} and idle == 0.5

    r = {"copy_bytes_per_s": 1e12, "offline_floor_s": 11.07,
         "model_bytes": {"dense": 1e9, "top_k": 8, "expert": [1e7, 1e7], "kv_per_token": 1e3},
         "offline": {"device_s": {"prefill": 3.21, "decode": 13.4, "idle": 0.2}},
         "decode": {"tok_s": 500.0, "profile": {"serial_us": {"gemm": 1200.0, "moe": 500.0, "other": 250.0},
                                                "idle_us": 50.0, "mean_kv_tokens": 100}}}
    assert shapes.offline_split(r) == "; device: prefill 3.2 s + decode 13.4 s (floor 11.1 s) + idle 0.2 s"
    assert shapes.decode_split(r) == ("; step 2.00 ms: dense weights 1.20 ms (floor 1.00), experts 0.50 ms "
                                      "(floor 0.16), other 0.25 ms, idle 0.05")
