"""The fp8 burst on the server of this tree (A) and on a copy of it in /tmp/treeB (B), each burst with the clients'
connections opened before the clock and inside it; the servers in turn A, B, B, A, each its own process (each
burst's prompt ids shifted so that the radix cache holds none of them). `h100-burst-intake.md` has the commands."""
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import bench.adapters as adapters
from bench.worker import _run_burst, _run_clients, burst_client_processes
from bench.workloads import Workload, offline_workload, random_prompt

OUT = Path(os.environ.get("OUT", "/tmp"))
ROOT_A = adapters.ROOT
model = str(ROOT_A / os.environ.get("EXP_MODEL", "models/qwen3-0.6b-shape-v49k"))
vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
base = offline_workload(True, False, vocab)
if os.environ.get("EXP_SMALL"):
    base = Workload(base.name, [p[:32] for p in base.prompts[:8]], [8] * 8)
dtype = os.environ.get("EXP_DTYPE", "bfloat16")
n = 0
order = ["A", "B", "B", "A", "A", "B"][: 2 * rounds]
for i, tree in enumerate(order):
    adapters.ROOT = ROOT_A if tree == "A" else Path("/tmp/treeB")
    if tree == "B":
        os.environ["TORCH_EXTENSIONS_DIR"] = os.environ.get("TORCH_EXTENSIONS_DIR_B", "/tmp/jit/torch_ext_b")
    elif "TORCH_EXTENSIONS_DIR_A" in os.environ:
        os.environ["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR_A"]
    step_log = OUT / f"steps-{i}-{tree}.jsonl"
    os.environ["MINISGL_STEP_LOG"] = str(step_log)
    t_start = time.perf_counter()
    with adapters.launch_server("stage4_fast", model, OUT / f"server-{i}-{tree}.log", dtype,
                                kv_cache_dtype="fp8_e4m3") as url:
        ready_s = time.perf_counter() - t_start
        asyncio.run(_run_clients(url, Workload("warm-up", [random_prompt(vocab, 16, seed=9 + i)], [4]), 1))
        for warm in (True, False) if i % 2 == 0 else (False, True):
            n += 1
            shift = 7919 * n
            w = Workload(base.name, [[100 + (t - 100 + shift) % (vocab - 200) for t in p] for p in base.prompts],
                         base.output_lens)
            res = _run_burst(url, w, burst_client_processes(), warm_connections=warm)
            time.sleep(1.0)  # the scheduler goes idle and writes its step log
            t0 = res["clock_s"][0]
            steps = [json.loads(line) for line in step_log.read_text().splitlines()] if step_log.exists() else []
            marks = {}
            for s in steps:
                if s["t"] < t0 - 0.3 or s["t"] > res["clock_s"][1]:
                    continue
                have = s["pending"] + s["running"]
                at = 1e3 * (s["t"] + (s["receive_ms"] + s["schedule_ms"]) / 1e3 - t0)
                for k in (1, 16, 64, 256):
                    if have >= k and k not in marks:
                        marks[k] = round(at, 1)
            pre = [s for s in steps if s["batch"] == "prefill" and t0 - 0.3 <= s["t"] <= res["clock_s"][1]]
            row = {"server": tree, "server_start_s": round(ready_s, 1), "warm_connections": warm,
                   "tok_s": round(res["tok_s"], 1), "seconds": res["seconds"],
                   "ttft_p50_ms": round(1e3 * sorted(res["ttft_s"])[len(res["ttft_s"]) // 2], 1),
                   "ttft_max_ms": round(1e3 * max(res["ttft_s"]), 1), "wrong_lengths": res["wrong_lengths"],
                   "requests_at_scheduler_ms": marks,
                   "last_prefill_ms": round(1e3 * (pre[-1]["t"] - t0), 1) if pre else None}
            print(json.dumps(row), flush=True)
            with open(OUT / "eager.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
