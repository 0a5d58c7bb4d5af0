"""``python -m stage0_tiny [--model DIR] [--prompt TEXT]``: generate, time it, and check against HF."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .tiny import TinyEngine

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"


def physical_cores() -> int:
    """Distinct (socket, core) pairs in /proc/cpuinfo; hyperthreads share a core and its FMA units."""
    try:
        pairs, phys = set(), "0"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "physical id":
                phys = val.strip()
            elif key.strip() == "core id":
                pairs.add((phys, val.strip()))
        cores = len(pairs)
    except OSError:
        cores = 0
    return max(1, min(cores or (os.cpu_count() or 1), len(os.sched_getaffinity(0))))


def timed_run(engine: TinyEngine, ids: list[int], n: int, threads: int) -> tuple[list[int], float, float]:
    torch.set_num_threads(threads)
    engine.generate(ids, 8)  # warm-up: first touches of the weights and allocator
    t0 = time.perf_counter()
    with torch.inference_mode():
        engine.kv = []
        engine.forward(torch.tensor(ids), 0)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    out = engine.generate(ids, n)
    total = time.perf_counter() - t0
    decode_tps = (len(out) - 1) / max(total - prefill_ms / 1e3, 1e-9)
    return out, prefill_ms, decode_tps


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m stage0_tiny", description=__doc__)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="HF model directory")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--no-hf-check", action="store_true")
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        print(f"error: no model at {args.model}. Prepare the default one with: python -m models prepare smollm2",
              file=sys.stderr)
        return 2

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    engine = TinyEngine(args.model)
    c = engine.cfg
    print(f"model: {args.model} ({c['architectures'][0]}, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
          f"{c['num_attention_heads']} q / {c['num_key_value_heads']} kv heads, vocab {c['vocab_size']})")
    ids = tok(args.prompt).input_ids
    print(f"prompt: {args.prompt!r} ({len(ids)} tokens)")
    default_threads, cores = torch.get_num_threads(), physical_cores()
    out, pre_ms, tps = timed_run(engine, ids, args.max_new_tokens, default_threads)
    print(f"generated: {tok.decode(out)!r}")
    print(f"timing ({default_threads} threads, torch default): prefill {pre_ms:.1f} ms, decode {tps:.1f} tok/s")
    _, pre_ms, tps = timed_run(engine, ids, args.max_new_tokens, cores)
    print(f"timing ({cores} threads = physical cores): prefill {pre_ms:.1f} ms, decode {tps:.1f} tok/s")
    if not args.no_hf_check:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        print(f"match HF: {ref == out}")
        if ref != out:
            print(f"  HF:   {ref}\n  ours: {out}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
