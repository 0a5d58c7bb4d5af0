"""What a process's first prefill steps of many requests spend their host launch on (h100-warm-up-step.md).

An LLM with the server's prefill step (8,192 tokens), then three generate calls (A, B, C) of 40 fresh prompts of
400-760 random ids, 4 tokens each; PROBE_WARM=1 first sends one 16-token request, as the benchmark's server warm-up.
Run from the repository root with MINISGL_STEP_LOG=FILE for the scheduler's step lines:

    PYTHONPATH=. python bench/results/raw/h100-warm-up-step-probe.py OUTDIR TAG {plain|torchprof|cprofile}

torchprof: A and B under the torch profiler (a table each and A's trace); cprofile: A and B under cProfile."""
import cProfile
import gzip
import json
import os
import pstats
import random
import sys
import time
import warnings

import torch

from stage4_fast.core import SamplingParams
from stage4_fast.llm import LLM

out, tag, how = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(out, exist_ok=True)
model = os.environ.get("PROBE_MODEL", "models/qwen3-0.6b-shape-v49k")
opts = dict(max_extend_tokens=8192, decode_between_chunks=True)
if torch.cuda.is_available():
    opts["kv_cache_dtype"] = "fp8_e4m3"
t = time.perf_counter()
llm = LLM(model, **opts)
walls = {"init_s": time.perf_counter() - t}
rng = random.Random(0)
sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

def prompts(n=40):
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(400, 760))] for _ in range(n)]

if os.environ.get("PROBE_WARM"):  # as the benchmark's server warm-up: one 16-token request first
    t = time.perf_counter()
    llm.generate([[rng.randrange(100, 40000) for _ in range(16)]], sp, use_tqdm=False)
    walls["W"] = time.perf_counter() - t
for run in "ABC":
    ps = prompts()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    if how == "torchprof" and run in "AB":
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            llm.generate(ps, sp, use_tqdm=False)
        with open(f"{out}/tprof-{tag}-{run}.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=70, max_name_column_width=80))
        if run == "A":
            p = f"{out}/trace-{tag}-A.json"
            prof.export_chrome_trace(p)
            with open(p, "rb") as f, gzip.open(p + ".gz", "wb") as g:
                g.write(f.read())
            os.remove(p)
    elif how == "cprofile" and run in "AB":
        pr = cProfile.Profile()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if run == "A" and torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            pr.enable()
            llm.generate(ps, sp, use_tqdm=False)
            pr.disable()
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
        with open(f"{out}/cprof-{tag}-{run}.txt", "w") as f:
            for key in ("tottime", "cumulative"):
                pstats.Stats(pr, stream=f).sort_stats(key).print_stats(60)
            f.write(f"\n{len(caught)} warnings\n")
            for w in caught[:40]:
                f.write(f"{w.filename}:{w.lineno}: {str(w.message)[:300]}\n")
    else:
        llm.generate(ps, sp, use_tqdm=False)
    walls[run] = time.perf_counter() - t
json.dump(walls, open(f"{out}/walls-{tag}.json", "w"))
print(tag, walls)
llm.shutdown()
