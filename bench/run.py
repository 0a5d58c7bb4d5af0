"""`python -m bench [run]`: HF transformers and every stage on the same model and workloads, plus the ablations.

Every engine and every ablation configuration runs in its own `python -m bench worker` process (one after another,
so they never compete for cores); this process only plans, shows progress, and writes `<machine>.md` + `.json` +
PNGs (`<machine>-quick.*` with --quick) into bench/local/ (gitignored), or with `--out bench/results` over the
committed results of that machine (no other machine's files are touched).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from . import meta
from .adapters import ENGINES, LLM_STAGES, SERVER_STAGES
from .meta import ROOT
from .report import TITLE, ablation_rows, ablation_table, markdown, plot_all, stage_table
from .shapes import MOE_SHAPE, make_command, shape_models
from .stream_client import DEFAULT_HTTP_CLIENT
from .workloads import SIZES, offline_workload

NO_PLOTS = 'note: matplotlib is not installed, so this run writes no plots (pip install -e ".[bench]")'
BUSY = 0.15  # a job during which other processes used more than this share of the CPUs was measured on a busy machine
CPU_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
GPU_MODEL = ROOT / "models" / "qwen3-0.6b-shape"
BURST_MODEL = ROOT / "models" / "qwen3-0.6b-shape-v49k"  # the same shape with the tokenizer's vocabulary
BURST_STEP_TOKENS = 16384  # the offline LLM's prefill step on a large GPU (stage4_fast/llm/llm.py)


@dataclass
class Job:
    key: str  # main:<engine> | serve:<engine> | abl:<name>:<config>
    stage: str
    tasks: list[str]
    options: dict = field(default_factory=dict)
    model: Path | None = None  # default: the run's model

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.stage} {'+'.join(self.tasks)}" + (f" [{opts}]" if opts else "")


def resolve_stages(names: list[str]) -> list[str]:
    out = []
    for name in (n for arg in names for n in arg.split(",") if n):
        match = [e for e in ENGINES if e == name or e.split("_")[0] == name]
        if not match:
            raise SystemExit(f"unknown stage {name!r}: use hf, stage0 ... stage4 (or the package names)")
        out += [m for m in match if m not in out]
    return [e for e in ENGINES if e in out]


def plan(engines: list[str], args: argparse.Namespace, gpus: int) -> tuple[list[Job], str | None, list[str]]:
    sizes = SIZES["gpu" if args.gpu else "cpu", args.quick]
    jobs = [Job(f"main:{e}", e, ["prefill", "decode", "offline"]) for e in engines]
    if not args.no_serve:
        jobs += [Job(f"serve:{e}", e, ["serve"]) for e in engines if e in SERVER_STAGES]
    notes: list[str] = []
    llm_stages = [e for e in engines if e in LLM_STAGES]
    a = args.ablation_stage or (llm_stages[-1] if llm_stages else None)
    if args.no_ablations:
        return jobs, None, ["ablations (--no-ablations)"]
    if a is None:
        return jobs, None, ["ablations: no stage2+ in this run"]
    if a not in engines:
        raise SystemExit(f"--ablation-stage {a} is not part of this run")
    budget_off = 2 * (sizes.long_prompt_len + sizes.long_running * 64)  # whole prompt in one step
    jobs += [
        Job("abl:radix:off", a, ["shared_prefix"], {"cache_type": "naive"}),
        Job("abl:radix:on", a, ["shared_prefix"], {"cache_type": "radix"}),
        Job("abl:chunked:off", a, ["long_prompt"], {"max_extend_tokens": budget_off}),
        Job("abl:chunked:on", a, ["long_prompt"], {"max_extend_tokens": sizes.chunk}),
        Job("abl:overlap:off", a, ["offline"], {"overlap_scheduling": False}),
        Job("abl:overlap:on", a, ["offline"], {"overlap_scheduling": True}),
        Job("abl:page:1", a, ["offline"], {"page_size": 1}),
        Job("abl:page:16", a, ["offline"], {"page_size": 16}),
    ]
    if "stage4_fast" in engines:
        # on a CPU graphs are off by default; asked for, they are stage4's emulation: the row shows what it costs
        jobs += [Job("abl:graph:off", "stage4_fast", ["decode", "offline"], {"cuda_graph_max_bs": 0}),
                 Job("abl:graph:on", "stage4_fast", ["decode", "offline"],
                     {} if args.gpu else {"cuda_graph_max_bs": 16})]
        if args.gpu:
            # one fresh long prompt to its first token, its prefill steps eager or replayed from CUDA graphs
            jobs += [Job("abl:graph:prefill-off", "stage4_fast", ["prefill"], {"prefill_cuda_graph": False}),
                     Job("abl:graph:prefill-on", "stage4_fast", ["prefill"], {})]
            # the GPU attention backends on the same workload: our Triton kernels vs FlashInfer (GPU only)
            jobs += [Job(f"abl:attn:{b}", "stage4_fast", ["offline"], {"attention_backend": b})
                     for b in ("triton", "fi")]
            # a long-running server's state: the prefix cache full of earlier requests (three calls per engine)
            warm = (("radix", {}), ("page16", {"page_size": 16}), ("naive", {"cache_type": "naive"}))
            jobs += [Job(f"abl:warm:{name}", "stage4_fast", ["offline_warm"], opts) for name, opts in warm]
            # the whole offline workload as one burst of streamed requests, against offline on the same model (one
            # whose vocabulary is the tokenizer's, so every token streams text), with the KV cache in the model's
            # dtype (bf16) and in fp8; offline and served each in its own process: a server started beside a live
            # engine sizes its KV pool from what that engine left free
            for tail, kv in (("", {}), ("-fp8_e4m3", {"kv_cache_dtype": "fp8_e4m3"})):
                jobs += [Job(f"abl:burst:offline{tail}", "stage4_fast", ["offline"], kv, BURST_MODEL),
                         Job(f"abl:burst:served{tail}", "stage4_fast", ["serve_offline"], kv, BURST_MODEL)]
            # the fp8 burst once more with the offline LLM's prefill step (the server's default is SGLang's and
            # vLLM's 8,192 on this GPU): what a server tuned for throughput rather than inter-token latency gets
            jobs.append(Job("abl:burst:served-fp8_e4m3-step16k", "stage4_fast", ["serve_offline"],
                            {"kv_cache_dtype": "fp8_e4m3", "max_extend_tokens": BURST_STEP_TOKENS}, BURST_MODEL))
            # the KV cache in the model's dtype (bf16) vs fp8, offline on the run's model
            jobs += [Job(f"abl:kv:{kv}", "stage4_fast", ["offline"], {"kv_cache_dtype": kv})
                     for kv in ("auto", "fp8_e4m3")]
            jobs.append(Job("abl:kv:fp8_e4m3-calculated", "stage4_fast", ["offline"],
                            {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True}))  # scales from data
            if "shapes" in (args.ablations or ()):  # only when named: its models take ~40 GB and minutes to make
                jobs += [Job(f"abl:shapes:{name}", "stage4_fast", ["shape"], {}, path)
                         for name, path in shape_models().items()]
                # the MoE shape once more without the fused backend's few-token path (fused_sorted: torch routing,
                # the pairs always sorted by expert)
                jobs += [Job(f"abl:shapes:{name}, fused_sorted", "stage4_fast", ["shape"],
                             {"moe_backend": "fused_sorted"}, path)
                         for name, path in shape_models().items() if name.startswith(MOE_SHAPE)]
        tp_model = _tp_model(args.model, 2)
        if args.gpu and gpus < 2:
            notes.append("TP 1 vs 2: needs 2 GPUs")
        elif tp_model is None:
            notes.append(f"TP 1 vs 2: the heads of {args.model.name} do not split over 2 ranks")
        else:
            jobs += [Job(f"abl:tp:{tp}", "stage4_fast", ["serve_offline"], {"tp": tp}, tp_model) for tp in (1, 2)]
    else:
        notes.append("CUDA graph on/off and TP 1 vs 2: need stage4_fast")
    if args.ablations is not None:  # a subset: keep the main jobs and the chosen ablation groups
        chosen = set(args.ablations)
        unknown = chosen - {j.key.split(":")[1] for j in jobs if j.key.startswith("abl:")}
        if unknown:
            raise SystemExit(f"--ablations: {sorted(unknown)} not available in this run")
        dropped = sorted({j.key.split(":")[1] for j in jobs if j.key.startswith("abl:")} - chosen)
        jobs = [j for j in jobs if not j.key.startswith("abl:") or j.key.split(":")[1] in chosen]
        if dropped:
            notes.append(f"ablations not chosen (--ablations): {', '.join(dropped)}")
    return jobs, a, notes


class ForeignCPU:
    """Share of the machine's CPU time that processes outside this run used (a noise gauge more direct than the
    load average, which also counts this run's own threads): all busy time in /proc/stat minus ours."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        t = os.times()
        return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()

    def share(self) -> float:
        busy, own, now = self._sample()
        busy0, own0, then = self.start
        return max(0.0, (busy - busy0) - (own - own0)) / max((now - then) * os.cpu_count(), 1e-9)


def _tp_model(model: Path, tp: int) -> Path | None:
    """`model` if its attention heads split over `tp` ranks, else the tiny Qwen3 (SmolLM2's 9 query / 3 KV heads
    do not split in 2), else None."""
    def splits(m: Path) -> bool:
        c = json.loads((m / "config.json").read_text())
        q, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
        return q % tp == 0 and (kv % tp == 0 or tp % kv == 0)

    fallback = ROOT / "models" / "tiny-qwen3"
    return model if splits(model) else fallback if (fallback / "config.json").exists() and splits(fallback) else None


def run_job(job: Job, args: argparse.Namespace, log_dir: Path) -> dict:
    log = log_dir / f"{job.key.replace(':', '_')}.log"
    cmd = [sys.executable, "-m", "bench", "worker", "--stage", job.stage, "--task", ",".join(job.tasks), "--json",
           "--model", meta.relative(job.model or args.model), "--options", json.dumps(job.options), "--log", str(log)]
    cmd += ["--quick"] * args.quick + ["--gpu"] * args.gpu
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0, foreign = time.perf_counter(), ForeignCPU()
    rec = {"stage": job.stage, "tasks": job.tasks, "options": job.options, "command": " ".join(cmd[1:])}
    try:
        with open(log, "ab") as err:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, timeout=args.timeout)
        if proc.returncode != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
            rec["error"] = "\n".join(tail) or f"exit {proc.returncode}"
        else:
            rec["result"] = json.loads(proc.stdout)
    except subprocess.TimeoutExpired:
        rec["error"] = f"timed out after {args.timeout} s"
    rec["seconds"] = time.perf_counter() - t0
    rec["foreign_cpu"] = foreign.share()
    rec["log"] = str(log)
    return rec


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench [run]", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced sizes (a few minutes on 2 cores); writes "
                                                         "<machine>-quick.*, never the machine's main results")
    ap.add_argument("--gpu", action="store_true", help="CUDA, bf16, Qwen3-0.6B shape, upstream's 256-request workload")
    ap.add_argument("--stages", nargs="+", default=["hf", "stage0", "stage1", "stage2", "stage3", "stage4"],
                    help="engines to run: hf stage0 ... stage4 (space or comma separated; default: all that exist)")
    ap.add_argument("--model", type=Path, default=None,
                    help=f"HF model directory (default: {CPU_MODEL.name} on CPU, {GPU_MODEL.name} with --gpu)")
    ap.add_argument("--ablation-stage", default=None, choices=LLM_STAGES,
                    help="stage the ablations run on (default: the newest stage2+ in the run)")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--ablations", nargs="+", default=None, metavar="NAME",
                    help="run only these ablation groups: radix chunked overlap page graph attn kv tp "
                         "warm burst shapes (default: all but shapes; kv, warm, burst and shapes on a GPU). kv: "
                         "bf16 vs fp8 KV cache offline; burst: the served burst against offline, bf16 and fp8 KV")
    ap.add_argument("--no-serve", action="store_true", help="skip the server jobs (TTFT / ITL at 1 and 16 clients)")
    ap.add_argument("--machine", default=None, help="results file key (default: cpu, or the GPU model, e.g. h200)")
    ap.add_argument("--out", type=Path, default=meta.LOCAL,
                    help="results directory (default: bench/local/, gitignored); `--out bench/results` replaces the "
                         "committed results of this machine")
    ap.add_argument("--rerun-busy", type=int, default=None, metavar="N",
                    help="measure again up to N jobs during which other processes used > 15%% of the CPUs, keeping "
                         "the quieter run (default: all of them in a full run, none with --quick)")
    ap.add_argument("--timeout", type=int, default=None, help="seconds per worker (default: 600 quick, 3600 full)")
    return ap


def _run_jobs(jobs: list[Job], args: argparse.Namespace, log_dir: Path, results: dict) -> list[str]:
    """Every job once, then the busy ones again (up to --rerun-busy): on a shared machine a job can land in someone
    else's busy minute; the quieter run is kept. Returns the keys of the jobs measured again."""
    bar = tqdm(jobs, desc="bench", unit="job", dynamic_ncols=True)
    for job in bar:
        bar.set_postfix_str(job.label)
        rec = run_job(job, args, log_dir)
        results["jobs"][job.key] = rec
        if "error" in rec:
            tqdm.write(f"[{job.key}] failed (log: {rec['log']}):\n  " + rec["error"].replace("\n", "\n  "))
    bar.close()
    busy = [job for job in jobs if "result" in results["jobs"][job.key]
            and results["jobs"][job.key]["foreign_cpu"] > BUSY][: args.rerun_busy]
    for job in tqdm(busy, desc="rerun busy jobs", unit="job", dynamic_ncols=True):
        rec, old = run_job(job, args, log_dir), results["jobs"][job.key]
        if "result" in rec and rec["foreign_cpu"] < old["foreign_cpu"]:
            rec["replaced_foreign_cpu"] = old["foreign_cpu"]
            results["jobs"][job.key] = rec
    return [job.key for job in busy]


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    args.timeout = args.timeout or (600 if args.quick else 3600)
    if args.rerun_busy is None:
        args.rerun_busy = 0 if args.quick else 1000
    if importlib.util.find_spec("matplotlib") is None:
        print(NO_PLOTS, file=sys.stderr)  # said now, not after an hour of measuring
    t_start = time.perf_counter()

    gpus = meta.gpus() if args.gpu else []
    if args.gpu and not gpus:
        raise SystemExit("--gpu: no NVIDIA GPU found (nvidia-smi)")
    if args.model is None:
        args.model = GPU_MODEL if args.gpu else CPU_MODEL
        if args.gpu and not (args.model / "config.json").exists():
            subprocess.run([sys.executable, "-m", "models", "make", GPU_MODEL.name, "--device", "cuda"], cwd=ROOT,
                           check=True)
    if not (args.model / "config.json").exists():
        raise SystemExit(f"no model at {args.model}; prepare the default one with: python -m models prepare smollm2")
    args.model = Path(os.path.abspath(args.model))  # not resolve(): the results print it relative to the repo

    skipped = []
    engines = []
    for e in resolve_stages(args.stages):
        if e == "hf" or importlib.util.find_spec(e) is not None:
            engines.append(e)
        else:
            skipped.append(f"{e} (not built yet)")
            print(f"note: {e} is not built yet — skipped", file=sys.stderr)
    jobs, abl_stage, notes = plan(engines, args, len(gpus))
    if any(j.model == BURST_MODEL for j in jobs) and not (BURST_MODEL / "config.json").exists():
        subprocess.run([sys.executable, "-m", "models", "make", BURST_MODEL.name, "--device", "cuda"], cwd=ROOT,
                       check=True)
    for name, path in shape_models().items():
        if any(j.model == path for j in jobs) and not (path / "config.json").exists():
            subprocess.run([sys.executable, *make_command(name)], cwd=ROOT, check=True)

    machine = args.machine or meta.machine_key(gpus, args.gpu)
    prefix = machine + ("-quick" if args.quick else "")
    written_up = args.out / f"{prefix}.md"
    if written_up.exists() and not written_up.read_text().startswith(TITLE):  # e.g. results/h200.md, a write-up
        raise SystemExit(f"{written_up} was written by hand, not by a run: choose another --out or --machine")
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-"))
    sizes = SIZES["gpu" if args.gpu else "cpu", args.quick]
    vocab = json.loads((args.model / "config.json").read_text()).get("vocab_size", 0)
    w = offline_workload(args.gpu, args.quick, vocab)
    load_before = meta.load()
    results: dict = {
        "engines": engines, "skipped": skipped, "ablation_stage": abl_stage, "ablation_notes": notes,
        "offline_workload": w.note + f" ({w.prompt_tokens:,} prompt / {w.output_tokens:,} output tokens)",
        "offline_requests": len(w.prompts), "sizes": asdict(sizes),
        "serve_requests": {str(c): sizes.serve_requests[c] for c in sizes.serve_clients}, "jobs": {},
        "http_client": DEFAULT_HTTP_CLIENT,
    }
    foreign = ForeignCPU()
    reruns = _run_jobs(jobs, args, log_dir, results)

    load_after = meta.load()
    start_load = float(load_before.split("/")[0])  # the end value includes this run's own threads
    results["meta"] = {
        "machine": machine, "quick": args.quick, "date": meta.now(), "command": meta.command("python -m bench", argv),
        "hardware": meta.hardware(gpus), "versions": meta.versions(args.gpu), "git": meta.git_commit(),
        "model": meta.relative(args.model), "dtype": "bfloat16" if args.gpu else "float32",
        "device": "cuda" if args.gpu else "cpu", "threads": next(
            (r["result"]["threads"] for r in results["jobs"].values() if "result" in r), None),
        "load_before": load_before, "load_after": load_after, "total_s": time.perf_counter() - t_start,
        "foreign_cpu": foreign.share(), "reruns": reruns,
        "load_note": (f"the machine was busy (1-min load average {start_load:.1f} on "
                      f"{len(os.sched_getaffinity(0))} cores at the start): timings are noisy")
        if start_load >= 1.5 else "",
        "busy_jobs": [k for k, r in results["jobs"].items() if r["foreign_cpu"] > BUSY],
        "json": f"{prefix}.json", "logs": str(log_dir),
    }
    results["meta"]["summary"] = (f"{machine}{' quick' if args.quick else ''}, {results['meta']['model']} "
                                  f"{results['meta']['dtype']}, {results['meta']['date']}")
    return _write_and_print(results, args.out, prefix, log_dir)


def _write_and_print(results: dict, out: Path, prefix: str, log_dir: Path) -> int:
    try:
        images = plot_all(results, out, prefix)
    except ImportError:  # the table still gets written
        images = []
        print(NO_PLOTS, file=sys.stderr)
    (out / f"{prefix}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{prefix}.md").write_text(markdown(results, images))

    print()
    print(stage_table(results))
    rows = ablation_rows(results)
    if rows:
        print()
        print(ablation_table(rows))
    print(f"\nwritten: {out / (prefix + '.md')} (+ .json, {', '.join(images)}); worker logs in {log_dir}; "
          f"{results['meta']['total_s'] / 60:.1f} min")
    return 1 if any("error" in r for r in results["jobs"].values()) else 0
