"""The KV ablation's rows of the benchmark report: offline bf16 vs fp8 on the main model, the server burst of each
on the burst model, and the fp8 burst against fp8 offline (each measured in its own process)."""

from __future__ import annotations

from bench.report import ablation_rows


def _job(model: str, **tasks) -> dict:
    return {"stage": "stage4_fast", "result": {"model": model, "tasks": tasks}}


def test_kv_ablation_rows():
    burst = {"workload": "w", "tok_s": 20_000.0, "client_processes": 4, "chunks_per_token": 1.0,
             **{f"{k}_p{q}_s": 0.01 for k in ("ttft", "itl", "tpot") for q in (50, 99)}}
    results = {"ablation_stage": "stage4_fast", "meta": {"model": "models/main", "device": "cuda"}, "jobs": {
        "abl:kv:auto": _job("models/main", offline={"workload": "w", "tok_s": 25_000.0}),
        "abl:kv:fp8_e4m3": _job("models/main", offline={"workload": "w", "tok_s": 35_000.0}),
        "abl:kv:burst-offline-auto": _job("models/v49k", offline={"workload": "w", "tok_s": 26_000.0}),
        "abl:kv:burst-served-auto": _job("models/v49k", serve_offline=dict(burst, tok_s=24_000.0)),
        "abl:kv:burst-offline-fp8_e4m3": _job("models/v49k", offline={"workload": "w", "tok_s": 37_000.0}),
        "abl:kv:burst-served-fp8_e4m3": _job("models/v49k", serve_offline=dict(
            burst, tok_s=33_300.0, server_cpu_busy={"scheduler_0": 0.97, "api server": 0.714})),
        "abl:kv:burst-served-fp8_e4m3-step16k": {**_job("models/v49k", serve_offline=dict(burst, tok_s=36_260.0)),
                                                 "options": {"kv_cache_dtype": "fp8_e4m3",
                                                             "max_extend_tokens": 16384}},
    }}
    rows = {r["name"]: r for r in ablation_rows(results)}
    assert rows["KV cache dtype"]["effect"] == "1.40×"
    assert rows["KV cache dtype (server burst)"]["effect"] == "1.39×"
    assert "models/v49k" in rows["KV cache dtype (server burst)"]["workload"]
    assert rows["served burst, fp8_e4m3 KV"]["effect"] == "90% of offline"
    # without the burst group, its row comes from the KV group's bf16 pair (the same measurement)
    assert rows["served burst"]["effect"] == "92% of offline"
    # where the serving path saturates: each server process's CPU during the burst (absent from older results)
    assert rows["served burst, fp8_e4m3 KV"]["on"].endswith("; CPU busy: api server 71%, scheduler_0 97%")
    assert "CPU busy" not in rows["served burst"]["on"]
    # the fp8 burst with the offline LLM's prefill step, against the same offline run
    step = rows["served burst, fp8_e4m3 KV, `--max-num-batched-tokens 16384`"]
    assert step["effect"] == "98% of offline" and "36,260 out tok/s" in step["on"]
