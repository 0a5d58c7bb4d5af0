"""`python -m bench tp`: tensor parallelism on 2 GPUs, TP 1 against TP 2.

1. fp32 token for token: tiny Qwen3 through stage4's offline `LLM` at TP 1 and TP 2 (NCCL) against HF `generate`.
2. bf16 agreement and speed: a Qwen3 shape with random weights (0.6B, then 8B while the deadline allows) on the
   upstream offline workload at TP 1 and TP 2 — output tok/s and how many sequences come out identical.

Every engine runs in a subprocess of its own (its GPU memory goes back with it); results are appended to
`OUT_DIR/tp.jsonl` as they come (the first line: date, command, commit, versions, machine), so a run stopped by a
time limit still leaves what it measured; `--deadline-s` starts no new step past that many seconds.

    python -m bench tp [--out OUT_DIR] [--deadline-s 300] [--shapes qwen3-8b-shape:256] [--no-tiny]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from . import meta
from .meta import ROOT

PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):", "Once upon a time,"]


def _one(args: argparse.Namespace) -> dict:
    """One engine in this process: generate and report outputs + timing."""
    import torch

    from stage4_fast import LLM, SamplingParams

    from .workloads import offline_upstream

    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    if args.workload == "prompts":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ROOT / "models" / "SmolLM2-135M-Instruct")
        prompts, lens = [tok(p).input_ids for p in PROMPTS], [16] * len(PROMPTS)
    else:
        w = offline_upstream(num_seqs=int(args.workload))
        prompts, lens = w.prompts, w.output_lens
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=dtype, tp=args.tp)
    load_s = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up (kernels compiled, graphs replayed once)
    t0 = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    llm.shutdown()
    tokens = [r["token_ids"] for r in out]
    return {"tp": args.tp, "load_s": load_s, "seconds": gen_s, "output_tokens": sum(map(len, tokens)),
            "tok_s": sum(map(len, tokens)) / gen_s, "token_ids": tokens}


def _hf(model: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "SmolLM2-135M-Instruct")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a dry run of this script (TP over gloo)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([tok(p).input_ids], device=device)
        g = m.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def _run(model: str, tp: int, dtype: str, workload: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "bench", "tp", "--one", "--model", model, "--tp", str(tp), "--dtype", dtype,
           "--workload", workload]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {"tp": tp, "error": f"timed out after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"tp": tp, "error": p.stderr[-3000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) for x, y in zip(a, b)]
    return {"identical": same, "sequences": len(a), "mean_common_prefix": sum(prefix) / max(len(prefix), 1),
            "mean_length": sum(map(len, a)) / max(len(a), 1)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--workload", default="256")
    ap.add_argument("--out", type=Path, default=meta.LOCAL / "tp", help="folder for tp.jsonl (default: bench/local/tp)")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="start no new step past this many seconds")
    ap.add_argument("--shapes", nargs="*", default=["qwen3-0.6b-shape:256", "qwen3-8b-shape:64"])
    ap.add_argument("--no-tiny", action="store_true", help="skip the fp32 tiny-model check against HF")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args)))
        return 0
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "tp.jsonl").open("a")

    def left() -> float:
        return args.deadline_s - (time.monotonic() - start)

    def record(rec: dict) -> None:
        rec = {k: v for k, v in rec.items() if k != "token_ids"}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(json.dumps(rec), flush=True)

    record({"run": meta.run_meta("python -m bench tp", argv, gpu=True)})
    if not args.no_tiny:
        tiny = str(ROOT / "models" / "tiny-qwen3")
        ref = _hf(tiny)
        runs = {tp: _run(tiny, tp, "fp32", "prompts", left()) for tp in (1, 2)}
        for tp, r in runs.items():
            record({"step": "tiny-qwen3 fp32 vs HF", "tp": tp, "equal_hf": r.get("token_ids") == ref,
                    **{k: r[k] for k in ("error",) if k in r}})
    for spec in args.shapes:
        name, n = spec.split(":")
        if left() < 60:
            record({"step": f"{name} bf16", "skipped": f"deadline ({left():.0f} s left)"})
            continue
        model = ROOT / "models" / name
        if not (model / "config.json").exists():
            subprocess.run([sys.executable, "-m", "models", "make", name, "--device", "cuda"], cwd=ROOT, check=True)
        res = {}
        for tp in (1, 2):
            if left() < 20:
                record({"step": f"{name} bf16", "tp": tp, "skipped": "deadline"})
                continue
            res[tp] = r = _run(str(model), tp, "bf16", n, left())
            record({"step": f"{name} bf16, upstream workload {n} seqs", **r})
        if all("token_ids" in res.get(tp, {}) for tp in (1, 2)):
            record({"step": f"{name} bf16 TP2 vs TP1", **_agreement(res[1]["token_ids"], res[2]["token_ids"]),
                    "speedup": res[2]["tok_s"] / res[1]["tok_s"]})
    return 0
