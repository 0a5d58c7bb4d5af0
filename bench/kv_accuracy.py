"""What storing the KV cache in fewer bits costs in accuracy (stage4_fast ``--kv-cache-dtype``), against the same
engine with a full-precision KV cache.

CPU (default): SmolLM2-135M-Instruct with fp32 weights, the torch attention backend, 32 text prompts x 64 greedy
tokens. Reference: the fp32 KV cache (``auto``). For bfloat16, fp8_e4m3 and fp8_e5m2 KV (fp8 at scale 1.0), and
fp8_e4m3+calc (``--calculate-kv-scales``: per-layer scales from the engine's calibration prefill):
  * free-running greedy: token agreement (share of the 32 x 64 output positions equal to the reference's), prompts
    whose 64 tokens are all equal, and the mean step of the first difference;
  * teacher-forced on the reference's tokens (so every step compares logits of the same context): relative L2
    of the logits per step (mean / p99 / max), the largest |logit difference|, argmax agreement on all steps and
    on clear steps (reference top-2 gap above ``--clear-gap``), and the smallest reference top-2 gap among the
    steps whose argmax changed (a change needs a gap below twice the largest logit difference).

Two more CPU rows simulate finer scales without an engine change: an fp32 pool whose stores round K/V to e4m3
(fake quantization) with scales from the same calibration prefill, per layer (it must equal fp8_e4m3+calc) and per
KV head (``sim:per-head``).

GPU (``--gpu``): the Qwen3-0.6B shape (random bf16 weights, ``python -m models make qwen3-0.6b-shape --device
cuda``). Reference: the bf16 KV cache, teacher-forced on HF bf16's greedy tokens (and HF's own logits, for scale);
fp8_e4m3 / fp8_e5m2 KV through each ``--backends`` entry, CUDA graphs on.

Writes ``<machine>-kv-cache.{json,md}`` (``cpu``, ``h200``, ...) into bench/local/, or ``--out``:

    python -m bench kv-accuracy --out bench/results             # CPU, ~25 min on 2 busy cores
    python -m bench kv-accuracy --gpu --backends triton fi --out bench/results
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest.mock import patch

import torch

from . import meta

SUBJECTS = ["the moon", "photosynthesis", "a lighthouse keeper", "binary search", "the French revolution",
            "volcanoes", "a chess tournament", "rainforests"]
TEMPLATES = ["Explain {} in simple terms.", "Write a short story about {}.", "List three facts about {}:",
             "Here is a poem about {}:\n"]
PROMPTS = [t.format(s) for s in SUBJECTS for t in TEMPLATES]  # 32 prompts


CALC = "+calc"  # a --kv name ending so: that dtype with calculate_kv_scales (scales from data)
SIMULATED = ("sim:per-layer", "sim:per-head")  # fake-quantized e4m3 rows (CPU)


def kv_config(name: str) -> dict:
    """EngineConfig fields of a --kv name (fp8_e4m3, fp8_e4m3+calc, ...)."""
    kv = name.removesuffix(CALC)
    return {"kv_cache_dtype": kv, "calculate_kv_scales": True} if name != kv else {"kv_cache_dtype": kv}


def calibration_absmax(path: Path, **config) -> torch.Tensor:
    """[2 (k/v), layers, kv_heads] absmax of K and V over the engine's own calibration prefill (--calculate-kv-scales),
    recorded where the torch backend stores them; its per-layer maxima give the engine's scales."""
    from stage4_fast.engine import Engine, EngineConfig
    from stage4_fast.engine.engine import kv_scales_from_absmax
    from stage4_fast.kvcache import MHAKVCache

    seen, store = {}, MHAKVCache.store_kv

    def recording(self, k, v, out_loc, layer_id):
        seen[layer_id] = torch.stack([k.abs().amax((0, 2)), v.abs().amax((0, 2))]).float()
        store(self, k, v, out_loc, layer_id)

    with patch.object(MHAKVCache, "store_kv", recording):
        engine = Engine(EngineConfig(str(path), **config, **kv_config("fp8_e4m3" + CALC)))
    absmax = torch.stack([seen[i] for i in range(len(seen))], dim=1)
    per_layer = kv_scales_from_absmax(absmax.amax(-1))
    assert torch.equal(per_layer, torch.tensor([engine.kv_cache.k_scales, engine.kv_cache.v_scales])), \
        "the recorded calibration is not the engine's"
    engine.shutdown()
    return absmax


@contextmanager
def fake_quantized_kv(k_scales: torch.Tensor, v_scales: torch.Tensor):
    """A full-precision pool whose stores round K/V to e4m3 at [layers, kv_heads] scales, as an fp8 pool would
    (kernel/ref.py quantize_kv / dequantize_kv, per head): the torch backend reads every row back from the pool."""
    from stage4_fast.kvcache import MHAKVCache

    store, e4m3 = MHAKVCache.store_kv, torch.float8_e4m3fn
    limit = torch.finfo(e4m3).max

    def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x [T, heads, dim], scale [heads]
        s = scale[:, None].to(x.device)
        return ((x.float() / s).clamp(-limit, limit).to(e4m3).to(x.dtype) * s).to(x.dtype)

    def store_kv(self, k, v, out_loc, layer_id):
        store(self, rounded(k, k_scales[layer_id]), rounded(v, v_scales[layer_id]), out_loc, layer_id)

    with patch.object(MHAKVCache, "store_kv", store_kv):
        yield


def teacher_forced(path: Path, prompts: list[list[int]], forced: list[list[int]], **config) -> torch.Tensor:
    from stage4_fast.tests.teacher_forcing import stage_logits

    return stage_logits(path, prompts, forced, **config)  # all prompts in one batch


def logit_stats(logits: torch.Tensor, ref: torch.Tensor, clear_gap: float) -> dict:
    """Per-step distance of ``logits`` from ``ref`` ([prompts, steps, vocab] fp32)."""
    rel = ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()
    top2 = ref.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    same = (logits.argmax(-1) == ref.argmax(-1)).flatten()
    clear = gap > clear_gap
    changed_gaps = gap[~same]
    return {
        "steps": rel.numel(),
        "rel_l2_mean": rel.mean().item(),
        "rel_l2_p99": rel.quantile(0.99).item(),
        "rel_l2_max": rel.max().item(),
        "max_abs_logit_diff": (logits - ref).abs().max().item(),
        "argmax_agreement": same.float().mean().item(),
        "clear_gap": clear_gap,
        "clear_steps": int(clear.sum()),
        "argmax_agreement_clear": same[clear].float().mean().item() if clear.any() else float("nan"),
        "min_gap_where_argmax_changed": changed_gaps.min().item() if changed_gaps.numel() else None,
    }


def token_stats(outputs: list[list[int]], ref: list[list[int]]) -> dict:
    pairs = [(o, r) for o, r in zip(outputs, ref)]
    equal = sum(a == b for o, r in pairs for a, b in zip(o, r))
    total = sum(len(r) for r in ref)
    # an output that stops early differs where it stops
    first_diff = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r))) for o, r in pairs]
    return {"token_agreement": equal / total, "prompts_identical": sum(o == r for o, r in pairs),
            "prompts": len(pairs), "mean_first_difference_step": sum(first_diff) / len(first_diff)}


def greedy(path: Path, prompts: list[list[int]], steps: int, **config) -> list[list[int]]:
    from stage4_fast import LLM, SamplingParams

    llm = LLM(str(path), **config)
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                           use_tqdm=False)
    finally:
        llm.shutdown()
    refused = [f"prompt {i}: {r['error']}" for i, r in enumerate(out) if "error" in r]
    if refused:  # a refused prompt has no tokens: counting it would measure the refusal, not the KV cache
        raise RuntimeError(f"the engine refused {len(refused)} of {len(out)} prompts; first: {refused[0]}")
    return [list(r["token_ids"]) for r in out]


def run_cpu(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    import models

    path = models.ensure("smollm2")  # (the bench package runs from the repository root, where models/ lives)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p).input_ids for p in PROMPTS]
    common = dict(dtype=torch.float32, attention_backend="torch")
    ref_tokens = greedy(path, prompts, args.steps, **common, max_running_req=len(prompts))
    ref_logits = teacher_forced(path, prompts, ref_tokens, **common)
    rows = {}
    if args.simulate:
        from stage4_fast.engine.engine import kv_scales_from_absmax

        absmax = calibration_absmax(path, **common)
        per_layer = kv_scales_from_absmax(absmax.amax(-1, keepdim=True)).expand_as(absmax)
        sims = {"sim:per-layer": per_layer, "sim:per-head": kv_scales_from_absmax(absmax)}
    for kv in [*args.kv, *(SIMULATED if args.simulate else ())]:
        t0 = time.perf_counter()
        sim = kv in SIMULATED
        config = {**common, **({} if sim else kv_config(kv))}
        with fake_quantized_kv(*sims[kv]) if sim else nullcontext():
            tokens = greedy(path, prompts, args.steps, **config, max_running_req=len(prompts))
            logits = teacher_forced(path, prompts, ref_tokens, **config)
        rows[kv] = {**token_stats(tokens, ref_tokens), **logit_stats(logits, ref_logits, args.clear_gap),
                    "seconds": time.perf_counter() - t0}
        print(kv, json.dumps(rows[kv]), flush=True)
    return {"model": "SmolLM2-135M-Instruct (fp32 weights)", "reference": "fp32 KV cache (auto)",
            "backend": "torch", "prompts": len(prompts), "steps": args.steps, "rows": rows}


def run_gpu(args: argparse.Namespace) -> dict:
    from stage4_fast.tests.teacher_forcing import hf_reference

    path = meta.ROOT / "models" / "qwen3-0.6b-shape"
    prompts, forced, hf_logits = hf_reference(path, num_prompts=args.gpu_prompts, steps=args.steps)
    graphs = dict(cuda_graph_max_bs=args.gpu_prompts)
    rows = {}
    for backend in args.backends:
        common = dict(dtype=torch.bfloat16, attention_backend=backend, **graphs)
        ref = teacher_forced(path, prompts, forced, **common)
        rows[f"{backend} bf16 KV vs HF bf16"] = logit_stats(ref, hf_logits, args.clear_gap)
        ref_tokens = greedy(path, prompts, args.steps, **common, max_running_req=len(prompts))
        for kv in args.kv:
            if kv == "bfloat16":
                continue
            t0 = time.perf_counter()
            logits = teacher_forced(path, prompts, forced, **common, **kv_config(kv))
            tokens = greedy(path, prompts, args.steps, **common, **kv_config(kv), max_running_req=len(prompts))
            rows[f"{backend} {kv} vs bf16 KV"] = {**token_stats(tokens, ref_tokens),
                                                  **logit_stats(logits, ref, args.clear_gap),
                                                  "seconds": time.perf_counter() - t0}
            print(backend, kv, json.dumps(rows[f"{backend} {kv} vs bf16 KV"]), flush=True)
    return {"model": "Qwen3-0.6B shape (random bf16 weights)", "reference": "bf16 KV cache (auto), same backend",
            "prompts": len(prompts), "steps": args.steps, "rows": rows}


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 100 else f"{v:,.1f}"
    return str(v)


def markdown(result: dict) -> str:
    cols = ["token_agreement", "prompts_identical", "mean_first_difference_step", "rel_l2_mean", "rel_l2_p99",
            "rel_l2_max", "max_abs_logit_diff", "argmax_agreement", "clear_steps", "argmax_agreement_clear",
            "min_gap_where_argmax_changed"]
    lines = [f"# KV cache dtype accuracy ({result['hardware']})", "",
             f"`{result['command']}` — {result['date']}, code {result['git']}, {result['versions']}.", "",
             f"Model: {result['model']}. Reference: {result['reference']}. {result['prompts']} prompts x "
             f"{result['steps']} greedy tokens; logits teacher-forced on the reference's tokens. Clear step: "
             f"reference top-2 logit gap > {result['clear_gap']}. fp8 rows store K/V at scale 1.0; `+calc`: "
             "`--calculate-kv-scales` (per-layer scales from a calibration prefill); `sim:`: e4m3 fake-quantized "
             "with that calibration's scales per layer / per KV head (CPU).", "",
             "| KV cache | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | " + " | ".join(_fmt(row.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench kv-accuracy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="the Qwen3-0.6B shape on a CUDA GPU, bf16")
    ap.add_argument("--kv", nargs="+", default=["bfloat16", "fp8_e4m3", "fp8_e4m3" + CALC, "fp8_e5m2"],
                    help=f"KV cache dtypes; the suffix {CALC} adds --calculate-kv-scales")
    ap.add_argument("--no-simulate", dest="simulate", action="store_false",
                    help="CPU: leave out the fake-quantized per-layer / per-head rows")
    ap.add_argument("--backends", nargs="+", default=["triton"], help="GPU: attention backends to measure")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--gpu-prompts", type=int, default=16)
    ap.add_argument("--clear-gap", type=float, default=None,
                    help="logits; default 1.0 on the GPU model (logit std ~30, as test_gpu), 0.5 on SmolLM2")
    ap.add_argument("--out", type=Path, default=meta.LOCAL, help="results folder (default: bench/local)")
    args = ap.parse_args(argv)
    if args.clear_gap is None:
        args.clear_gap = 1.0 if args.gpu else 0.5
    torch.manual_seed(0)
    header = meta.run_meta("python -m bench kv-accuracy", argv, gpu=args.gpu)
    result = {**header, **(run_gpu(args) if args.gpu else run_cpu(args)), "clear_gap": args.clear_gap}
    stem = f"{meta.machine_key(meta.gpus() if args.gpu else [], args.gpu)}-kv-cache"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0
