"""TP sharding at a real model's widths, on a CPU: fp32 greedy of stage4 at TP 1 and TP N (gloo) against HF.

The GPU TP runs (`python -m bench tp`) compare bf16 outputs, where TP's different reduction order rounds differently;
this check removes rounding from the question. It takes a shape from models/random_models.py (e.g. the Qwen3-8B
shape: 32 query / 8 KV heads, intermediate 12288, vocabulary 151,936, untied head), keeps its widths, cuts its
depth to --layers so it fits a CPU, and asks for token-for-token equality in fp32.

    python tools/tp_width_check.py --shape qwen3-8b-shape --layers 2 --tp 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):", "Once upon a time,"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b-shape")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="append the result as one JSON line to this file")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models import random_models
    from stage4_fast import LLM, SamplingParams

    spec = random_models.RANDOM_MODELS[args.shape]
    name = f"{args.shape}-{args.layers}l"
    random_models.RANDOM_MODELS[name] = dataclasses.replace(spec, config={**spec.config,
                                                                           "num_hidden_layers": args.layers})
    with tempfile.TemporaryDirectory(prefix="tp-width-") as tmp:
        model_dir = random_models.make_random_model(name, dtype="float32", out=Path(tmp) / name)
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok(p).input_ids for p in PROMPTS]

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = []
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False)
            want.append(out[0, len(ids):].tolist())
        del hf

        result: dict = {"check": f"{name} fp32 greedy, stage4 TP 1 and TP {args.tp} (gloo) vs HF",
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tokens": want}
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        for tp in (1, args.tp):
            t0 = time.perf_counter()
            llm = LLM(str(model_dir), dtype=torch.float32, tp=tp, num_page_override=4096)
            got = [r["token_ids"] for r in llm.generate(prompts, params, use_tqdm=False)]
            llm.shutdown()
            result[f"tp{tp}_equal_hf"] = got == want
            result[f"tp{tp}_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if all(v for k, v in result.items() if k.endswith("_equal_hf")) else 1


if __name__ == "__main__":
    sys.exit(main())
