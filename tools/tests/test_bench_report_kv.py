"""The KV and burst ablation groups: the jobs each plans, and their rows of the benchmark report (offline bf16 vs
fp8 on the main model; on the burst model the server burst of each against offline, and the two bursts against each
other, each measured in its own process)."""

from __future__ import annotations

import argparse
import json

from bench import run
from bench.report import ablation_rows


def _job(model: str, **tasks) -> dict:
    return {"stage": "stage4_fast", "result": {"model": model, "tasks": tasks}}


def _results() -> dict:
    burst = {"workload": "w", "tok_s": 20_000.0, "client_processes": 4, "chunks_per_token": 1.0,
             **{f"{k}_p{q}_s": 0.01 for k in ("ttft", "itl", "tpot") for q in (50, 99)}}
    return {"ablation_stage": "stage4_fast", "meta": {"model": "models/main", "device": "cuda"}, "jobs": {
        "abl:kv:auto": _job("models/main", offline={"workload": "w", "tok_s": 25_000.0}),
        "abl:kv:fp8_e4m3": _job("models/main", offline={"workload": "w", "tok_s": 35_000.0}),
        "abl:burst:offline": _job("models/v49k", offline={"workload": "w", "tok_s": 26_000.0}),
        "abl:burst:served": _job("models/v49k", serve_offline=dict(burst, tok_s=24_000.0)),
        "abl:burst:offline-fp8_e4m3": _job("models/v49k", offline={"workload": "w", "tok_s": 37_000.0}),
        "abl:burst:served-fp8_e4m3": _job("models/v49k", serve_offline=dict(
            burst, tok_s=33_300.0, server_cpu_busy={"scheduler_0": 0.97, "api server": 0.714})),
        "abl:burst:served-fp8_e4m3-step16k": {**_job("models/v49k", serve_offline=dict(burst, tok_s=36_260.0)),
                                              "options": {"kv_cache_dtype": "fp8_e4m3", "max_extend_tokens": 16384}},
    }}


def test_kv_and_burst_rows():
    rows = {r["name"]: r for r in ablation_rows(_results())}
    assert rows["KV cache dtype"]["effect"] == "1.40×"
    assert rows["KV cache dtype (server burst)"]["effect"] == "1.39×"
    assert "models/v49k" in rows["KV cache dtype (server burst)"]["workload"]
    assert rows["served burst, fp8_e4m3 KV"]["effect"] == "90% of offline"
    assert rows["served burst"]["effect"] == "92% of offline"
    # where the serving path saturates: each server process's CPU during the burst (absent from older results)
    assert rows["served burst, fp8_e4m3 KV"]["on"].endswith("; CPU busy: api server 71%, scheduler_0 97%")
    assert "CPU busy" not in rows["served burst"]["on"]
    # the fp8 burst with the offline LLM's prefill step, against the same offline run
    step = rows["served burst, fp8_e4m3 KV, `--max-num-batched-tokens 16384`"]
    assert step["effect"] == "98% of offline" and "36,260 out tok/s" in step["on"]


def test_results_from_when_the_kv_group_ran_the_bursts_give_the_same_rows():
    new = _results()
    old_names = {"abl:burst:offline": "abl:kv:burst-offline-auto", "abl:burst:served": "abl:kv:burst-served-auto",
                 **{f"abl:burst:{k}": f"abl:kv:burst-{k}"
                    for k in ("offline-fp8_e4m3", "served-fp8_e4m3", "served-fp8_e4m3-step16k")}}
    old = {**new, "jobs": {old_names.get(k, k): job for k, job in new["jobs"].items()}}
    assert ablation_rows(old) == ablation_rows(new)


def test_each_group_plans_its_own_jobs_and_none_twice(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}))
    base = dict(gpu=True, quick=False, no_serve=True, ablation_stage=None, no_ablations=False, model=model)

    def planned(ablations: list[str] | None) -> dict[str, run.Job]:
        jobs, _, _ = run.plan(["stage4_fast"], argparse.Namespace(**base, ablations=ablations), 1)
        return {j.key: j for j in jobs if j.key.startswith("abl:")}

    kv = planned(["shapes", "kv"])
    assert {k for k in kv if not k.startswith("abl:shapes:")} == {
        "abl:kv:auto", "abl:kv:fp8_e4m3", "abl:kv:fp8_e4m3-calculated"}
    assert all(kv[k].tasks == ["offline"] and kv[k].model is None for k in kv if k.startswith("abl:kv:"))
    burst = planned(["burst"])
    assert set(burst) == {"abl:burst:offline", "abl:burst:served", "abl:burst:offline-fp8_e4m3",
                          "abl:burst:served-fp8_e4m3", "abl:burst:served-fp8_e4m3-step16k"}
    assert all(j.model == run.BURST_MODEL for j in burst.values())
    assert burst["abl:burst:served-fp8_e4m3-step16k"].options == {
        "kv_cache_dtype": "fp8_e4m3", "max_extend_tokens": run.BURST_STEP_TOKENS}
    # the default run: no two jobs measure the same thing (kv_cache_dtype "auto" is the default)
    every = planned(None).values()
    same = {(j.stage, tuple(j.tasks), j.model, json.dumps({k: v for k, v in j.options.items()
                                                         if (k, v) != ("kv_cache_dtype", "auto")}, sort_keys=True))
            for j in every}
    assert len(same) == len(every)
