"""CPU offline throughput, the stage2 issue's benchmark: HF transformers vs stage1 (static batches) vs stage2
(continuous batching), plus the radix cache on a shared-prefix workload.

    python -m bench.offline [--model DIR] [--out bench/results/cpu-offline.md] [--engines hf stage1 stage2]

Workloads (bench/workloads.py, token ids, EOS ignored, greedy, fp32):
* offline: 16 requests, random.seed(0), prompts of randint(32, 256) ids drawn with randint(100, vocab - 100), then
  output lengths randint(16, 128). Output tok/s = output tokens / wall time of one generate call (after a warm-up).
* shared prefix: 16 requests = one 512-token system prompt + a 32-token question each, 16 output tokens; stage2
  with the radix cache vs the naive cache: prefill tokens computed, the share of the system prompts served from
  the cache, and the speedup.

Each row runs in its own process (`--worker`), one after another, so rows do not compete for the cores and no
engine state leaks between them. A stage package that does not exist is reported as missing, not as a failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
DEFAULT_OUT = ROOT / "bench" / "results" / "cpu-offline.md"
ALIASES = {"hf": "hf", "stage1": "stage1_correct", "stage2": "stage2_scheduled"}
PREFIX = dict(num_seqs=16, system_len=512, question_len=32, output_len=16)

# (row label, engine, workload, engine options)
ROWS = [
    ("HF transformers (padded batch)", "hf", "offline", {}),
    ("stage1 (static batch)", "stage1_correct", "offline", {}),
    ("stage2 (continuous batching, overlap on)", "stage2_scheduled", "offline", {}),
    ("stage2 (overlap off)", "stage2_scheduled", "offline", {"overlap_scheduling": False}),
    ("stage2 shared prefix, radix", "stage2_scheduled", "prefix", {"cache_type": "radix"}),
    ("stage2 shared prefix, naive", "stage2_scheduled", "prefix", {"cache_type": "naive"}),
]


def workload(name: str, vocab_size: int):
    sys.path.insert(0, str(ROOT))
    from bench.workloads import offline_cpu, shared_prefix

    return offline_cpu(vocab_size) if name == "offline" else shared_prefix(vocab_size, **PREFIX)


def run_worker(engine: str, workload_name: str, model: str, options: dict) -> dict:
    """One row, in this process: load, warm up, time one generate call."""
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.adapters import load_adapter

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    w = workload(workload_name, vocab)
    adapter = load_adapter(engine, model, torch.device("cpu"), torch.float32, **options)
    # warm-up (first touch of weights, allocator, thread pool) on ids outside the workload, so that it leaves nothing
    # in a prefix cache that the timed call could use
    adapter.generate([list(range(100, 116))], [4])
    prefill_before = getattr(adapter, "prefill_tokens", 0)
    start = time.perf_counter()
    result = adapter.generate(w.prompts, w.output_lens)
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "output_tokens": sum(map(len, result.outputs)),
        "prompt_tokens": w.prompt_tokens,
        "prefill_tokens": getattr(adapter, "prefill_tokens", 0) - prefill_before if engine != "hf" else None,
        "outputs": result.outputs,
        "threads": torch.get_num_threads(),
    }


def run_row(engine: str, workload_name: str, model: str, options: dict, env: dict) -> dict:
    if engine != "hf" and not (ROOT / engine / "__init__.py").exists():
        return {"missing": f"{engine} is not built yet"}
    options_json = json.dumps(options)
    cmd = [sys.executable, "-m", "bench.offline", "--worker", engine, workload_name, options_json, "--model", model]
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["load"] = f"{load_before:.1f}/{os.getloadavg()[0]:.1f}"  # 1-min load average before/after the row
    return res


def machine() -> str:
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores, {platform.system()} {platform.release()}"


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def report(
    results: list[tuple[str, str, str, dict, dict]],
    args: argparse.Namespace,
    started: str,
    load_before: str,
    load_after: str,
    total_s: float,
) -> str:
    import torch
    import transformers

    by_label = {label: res for label, _, _, _, res in results}
    hf = by_label.get(ROWS[0][0], {})
    hf_rate = hf["output_tokens"] / hf["seconds"] if "seconds" in hf else None
    hf_out = hf.get("outputs")
    lines = [
        "# CPU offline benchmark (stage2 issue)",
        "",
        f"- date: {started}",
        f"- machine: {machine()}",
        f"- command: `{' '.join(['python -m bench.offline', *sys.argv[1:]])}`",
        f"- model: {Path(args.model).name}, fp32, greedy, EOS ignored; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; OMP_WAIT_POLICY="
        f"{'PASSIVE' if args.omp_passive else os.environ.get('OMP_WAIT_POLICY', 'unset (library default)')}",
        f"- load average (1/5/15 min) before: {load_before}, after: {load_after}; total {total_s:.0f} s. The machine "
        "(2 cores) is shared: with other work running, every engine slows down several times (two OpenMP threads "
        "wait for each other), so compare rows only at low load.",
        "",
        "## Offline workload: 16 requests, seed 0, prompts randint(32, 256), outputs randint(16, 128)",
        "",
        "| engine | output tokens | seconds | output tok/s | vs HF | outputs equal HF | load before/after |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for label, _, wname, _, res in results:
        if wname != "offline":
            continue
        if "seconds" not in res:
            lines.append(f"| {label} | — | — | — | — | {res.get('missing') or res.get('error')} | |")
            continue
        rate = res["output_tokens"] / res["seconds"]
        vs = f"{rate / hf_rate:.2f}×" if hf_rate else "—"
        same = (
            "—"
            if hf_out is None or label == ROWS[0][0]
            else (f"{sum(a == b for a, b in zip(res['outputs'], hf_out))}/{len(hf_out)}")
        )
        lines.append(
            f"| {label} | {res['output_tokens']} | {res['seconds']:.1f} | {rate:.1f} | {vs} | {same} | {res['load']} |"
        )
    radix = by_label.get(ROWS[4][0], {})
    naive = by_label.get(ROWS[5][0], {})
    lines += [
        "",
        f"## Shared prefix: {PREFIX['num_seqs']} requests = {PREFIX['system_len']}-token system prompt + "
        f"{PREFIX['question_len']}-token question, {PREFIX['output_len']} output tokens",
        "",
        "| cache | prefill tokens computed | seconds | output tok/s | load before/after |",
        "|---|---:|---:|---:|---|",
    ]
    for name, res in (("radix", radix), ("naive", naive)):
        if "seconds" in res:
            lines.append(
                f"| {name} | {res['prefill_tokens']} of {res['prompt_tokens']} | {res['seconds']:.1f} | "
                f"{res['output_tokens'] / res['seconds']:.1f} | {res['load']} |"
            )
        else:
            lines.append(f"| {name} | {res.get('missing') or res.get('error')} | | | |")
    if "seconds" in radix and "seconds" in naive:
        shared_total = PREFIX["num_seqs"] * PREFIX["system_len"]
        served = naive["prefill_tokens"] - radix["prefill_tokens"]
        same = radix["outputs"] == naive["outputs"]
        lines += [
            "",
            f"Served from the radix cache: {served} of {shared_total} shared system-prompt tokens "
            f"({100 * served / shared_total:.1f} %; the first request has to compute it: at most "
            f"{100 * (PREFIX['num_seqs'] - 1) / PREFIX['num_seqs']:.1f} %). Speedup radix vs naive: "
            f"{naive['seconds'] / radix['seconds']:.2f}×. Outputs identical: {same}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--engines", nargs="*", choices=sorted(ALIASES), default=sorted(ALIASES))
    ap.add_argument(
        "--omp-passive",
        action="store_true",
        help="run every row with OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of spinning): on a "
        "machine shared with other jobs this keeps two threads from stalling each other",
    )
    ap.add_argument("--worker", nargs=3, metavar=("ENGINE", "WORKLOAD", "OPTIONS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        engine, wname, options = args.worker
        res = run_worker(engine, wname, args.model, json.loads(options))
        print(json.dumps(res))
        return 0
    if not (Path(args.model) / "config.json").exists():
        print(f"error: no model at {args.model}; prepare it with `python -m models prepare smollm2`", file=sys.stderr)
        return 1
    wanted = {ALIASES[e] for e in args.engines}
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE") if args.omp_passive else dict(os.environ)
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load_before, t0 = load(), time.perf_counter()
    results = []
    for label, engine, wname, options in ROWS:
        if engine not in wanted:
            continue
        print(f"{label} ...", file=sys.stderr, flush=True)
        res = run_row(engine, wname, args.model, options, env)
        if "seconds" in res:
            print(
                f"  {res['output_tokens']} tokens in {res['seconds']:.1f} s = "
                f"{res['output_tokens'] / res['seconds']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(f"  {res}", file=sys.stderr, flush=True)
        results.append((label, engine, wname, options, res))
    text = report(results, args, started, load_before, load(), time.perf_counter() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
