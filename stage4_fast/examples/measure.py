"""Quick speed figures for this stage (not a test; the bench/ package produces the official rows):
single-request prefill ms and decode tok/s, and the decode throughput of a 4-request batch.

    python -m stage4_fast.examples.measure [--model DIR] [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from typing import List, Sequence, Tuple

import torch

from stage4_fast.core import SamplingParams
from stage4_fast.engine import Engine, EngineConfig, ManualBatcher
from stage4_fast.examples.stage1_milestone import PROMPTS
from stage4_fast.utils.hf import load_tokenizer, resolve_model_path


def timed_run(batcher: ManualBatcher, prompts: Sequence[List[int]], new_tokens: int) -> Tuple[float, float]:
    """(prefill ms, decode tokens/s over all requests) for one static batch."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    reqs = [batcher.add_req(p, params) for p in prompts]
    t0 = time.perf_counter()
    batcher.step(reqs, "prefill")
    t1 = time.perf_counter()
    steps = 0
    while running := [r for r in reqs if r.can_decode]:
        batcher.step(running, "decode")
        steps += 1
    t2 = time.perf_counter()
    for req in reqs:
        batcher.free_req(req)
    return (t1 - t0) * 1e3, steps * len(reqs) / (t2 - t1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of N (the machine may be shared)")
    args = parser.parse_args(argv)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    engine = Engine(EngineConfig(path, dtype=torch.float32, max_running_req=8, num_page_override=1024))
    batcher = ManualBatcher(engine)
    timed_run(batcher, prompts, 4)  # warm-up
    single = [timed_run(batcher, prompts[:1], args.new_tokens) for _ in range(args.repeats)]
    batch = [timed_run(batcher, prompts, args.new_tokens) for _ in range(args.repeats)]
    prefill_ms = min(s[0] for s in single)
    single_tps = max(s[1] for s in single)
    batch_tps = max(b[1] for b in batch)
    print(f"threads: {torch.get_num_threads()}  new tokens: {args.new_tokens}  best of {args.repeats}")
    print(f"single request: prefill {prefill_ms:.1f} ms ({len(prompts[0])} tokens), decode {single_tps:.1f} tok/s")
    print(f"4-request batch: decode {batch_tps:.1f} tok/s = {batch_tps / single_tps:.2f}x single")


if __name__ == "__main__":
    main()
