"""One-step generates (max_tokens 1) of given token and request counts, each twice, on an LLM with 8,192-token
prefill steps and fp8 KV: with the scheduler's step log (MINISGL_STEP_LOG, h100-gemm-first-calls-step-log.patch),
the host time of each prefill step's launch; cProfile of three more.

    PYTHONPATH=. MINISGL_STEP_LOG=s.jsonl python bench/results/raw/h100-gemm-first-calls-prefill-sizes.py MODEL OUT
"""

import cProfile
import io
import json
import pstats
import sys
import time

import torch

from stage4_fast.core import SamplingParams
from stage4_fast.llm import LLM


def main(model: str, out: str) -> None:
    llm = LLM(model, kv_cache_dtype="fp8_e4m3", max_extend_tokens=8192)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    results = []

    def prompts(total: int, n: int) -> list[list[int]]:
        lens = [total // n] * n
        lens[-1] += total - sum(lens)
        return [torch.randint(0, 40000, (n_tokens,), generator=gen).tolist() for n_tokens in lens]

    def one(total: int, n: int, profile: bool = False) -> None:
        ps = prompts(total, n)
        torch.cuda.synchronize()
        prof = cProfile.Profile() if profile else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        llm.generate(ps, params)
        if prof:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            with open(f"{out}/prof_{total}_{n}.txt", "w") as f:
                f.write(text.getvalue())
        results.append({"total": total, "n": n, "ms": (time.perf_counter() - t) * 1e3})
        print(results[-1], flush=True)

    for total, n in [(8192, 1), (8192, 1), (8192, 16), (8192, 16), (7301, 14), (7301, 14), (3943, 5), (3943, 5),
                     (508, 1), (508, 1), (6000, 9), (6000, 9), (5000, 7)]:
        one(total, n)
    one(4321, 6, profile=True)
    one(4321, 6, profile=True)
    one(2999, 3, profile=True)
    with open(f"{out}/sizes.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
