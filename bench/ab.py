"""`python -m bench ab --base REV --model DIR`: this checkout against another commit, in alternating rounds.

A change worth a percent or two is smaller than what one machine drifts between runs (its load, its clocks, which
kernels a fresh process compiles first), so a before/after pair of runs proves little. This command takes the tree
of ``--base`` (``git archive``, into a temporary folder) and, round after round, runs the same worker (`python -m
bench worker`) on this checkout and on the base tree in turn (who goes first alternates), each in a process of its
own, for every ``--options`` set; it reports each round's difference and the means. Each tree keeps its own torch
extension build folder, so that the CUDA kernels of one are never rebuilt over the other's; the first round of each
pays its builds (the report shows the load times).

Example (one H200, the offline workload with an fp8 KV cache, five rounds):

    python -m bench ab --base HEAD~1 --gpu --model models/qwen3-0.6b-shape --rounds 5 \\
        --options '{"kv_cache_dtype": "fp8_e4m3"}' --options '{"kv_cache_dtype": "auto"}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .meta import LOCAL, ROOT, header_lines, relative, run_meta, write_report

THIS = "this checkout"


@dataclass(frozen=True)
class Run:
    round: int
    tree: str  # THIS or the base revision
    options: str  # the engine options as JSON


def plan(rounds: int, option_sets: list[str], base: str) -> list[Run]:
    """The order of the runs: round by round, every option set, both trees; this checkout goes first in odd rounds
    and the base in even ones, so that neither always runs on a machine the other has just warmed."""
    return [Run(r, tree, opts) for r in range(1, rounds + 1) for opts in option_sets
            for tree in ((THIS, base) if r % 2 else (base, THIS))]


def summarize(results: list[tuple[Run, float]], base: str) -> list[dict]:
    """Per option set: each tree's mean, the per-round differences (this checkout minus base) and the change."""
    rows = []
    for opts in dict.fromkeys(run.options for run, _ in results):
        mine = {run.round: v for run, v in results if run.options == opts and run.tree == THIS}
        theirs = {run.round: v for run, v in results if run.options == opts and run.tree == base}
        both = sorted(set(mine) & set(theirs))
        if not both:
            continue
        a, b = [mine[r] for r in both], [theirs[r] for r in both]
        rows.append({"options": opts, "rounds": len(both), "base_mean": statistics.mean(b),
                     "this_mean": statistics.mean(a), "differences": [x - y for x, y in zip(a, b)],
                     "change_pct": 100 * (statistics.mean(a) / statistics.mean(b) - 1)})
    return rows


def export_tree(rev: str, dest: Path) -> str:
    """The tree of ``rev`` into ``dest``; returns its short hash."""
    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True)
    if short.returncode != 0:
        raise SystemExit(f"python -m bench ab: {rev!r} is not a commit of this repository ({short.stderr.strip()})")
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "archive", rev], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"python -m bench ab: git archive {rev} failed")
    return short.stdout.strip()


def run_worker(tree: Path, build_dir: Path, args: argparse.Namespace, options: str) -> dict:
    cmd = [sys.executable, "-m", "bench", "worker", "--stage", args.stage, "--task", args.task, "--model",
           os.path.abspath(args.model), "--options", options, "--json"]
    cmd += ["--gpu"] if args.gpu else []
    cmd += ["--quick"] if args.quick else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
               TORCH_EXTENSIONS_DIR=str(build_dir))
    proc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise SystemExit(f"python -m bench ab: the worker failed in {tree} (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(info: dict, rows: list[dict], runs: list[dict], base: str, task: str) -> str:
    lines = [f"# `bench ab`: {THIS} against {base}", "", *header_lines(info), "",
             f"| options | rounds | {base} | {THIS} | difference per round | change |", "|---|---:|---:|---:|---|---:|"]
    for row in rows:
        diffs = ", ".join(f"{d:+,.0f}" for d in row["differences"])
        lines.append(f"| `{row['options']}` | {row['rounds']} | {row['base_mean']:,.1f} | {row['this_mean']:,.1f} "
                     f"| {diffs} | {row['change_pct']:+.2f} % |")
    lines += ["", f"`{task}` tok/s, means over the rounds. Every run, in order:", "",
              "| round | tree | options | tok/s | load s |", "|---:|---|---|---:|---:|"]
    lines += [f"| {r['round']} | {r['tree']} | `{r['options']}` | {r['tok_s']:,.1f} | {r['load_s']:.1f} |"
              for r in runs]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with (any git revision)")
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--stage", default="stage4_fast", help="the engine (a stage package; default stage4_fast)")
    ap.add_argument("--task", default="offline", help="one worker task with a tok_s figure (default offline)")
    ap.add_argument("--options", action="append", default=None,
                    help="engine options as JSON, repeatable: each set runs in every round (default {})")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gpu", action="store_true", help="CUDA, bf16, the GPU workloads (as `bench worker --gpu`)")
    ap.add_argument("--quick", action="store_true", help="the reduced sizes of `python -m bench --quick`")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one worker run may take")
    ap.add_argument("--out", default=None, help="report path (.md; the runs go beside it as .json); default "
                                                "bench/local/ab-BASE.md")
    args = ap.parse_args(argv)
    option_sets = args.options or ["{}"]
    for opts in option_sets:
        json.loads(opts)  # a typo fails here, not after the first round
    info = run_meta("python -m bench ab", argv, gpu=args.gpu)
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        base = export_tree(args.base, base_tree)
        builds = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(tmp) / "torch_extensions")
        trees = {THIS: (ROOT, builds / "ab-this"), base: (base_tree, builds / f"ab-{base}")}
        results, runs = [], []
        for run in plan(args.rounds, option_sets, base):
            tree, build_dir = trees[run.tree]
            out = run_worker(tree, build_dir, args, run.options)
            tok_s = out["tasks"][args.task]["tok_s"]
            results.append((run, tok_s))
            runs.append({"round": run.round, "tree": run.tree, "options": run.options, "tok_s": tok_s,
                         "load_s": out.get("load_s", 0.0)})
            print(f"round {run.round} {run.tree} {run.options}: {tok_s:,.1f} tok/s", file=sys.stderr, flush=True)
    rows = summarize(results, base)
    out_md = Path(args.out) if args.out else LOCAL / f"ab-{base}.md"
    info["base"], info["model"], info["task"] = base, relative(args.model), args.task
    write_report(out_md, report(info, rows, runs, base, args.task))
    out_md.with_suffix(".json").write_text(json.dumps({**info, "summary": rows, "runs": runs}, indent=1) + "\n")
    return 0
