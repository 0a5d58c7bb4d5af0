"""`python -m bench serve`: one server's time to first token and tokens/s at 1 and 16 concurrent clients (CPU), and
with `--rates` a request-rate sweep.

Starts `python -m <stage> --model DIR` (the newest served stage by default, SmolLM2 fp32), warms it up, then for
each concurrency runs the `serve` workload of `workloads.py` (token-id prompts of randint(32, 256) tokens, 64 output
tokens, EOS ignored, greedy, `/v1/completions` streamed) with that many clients, each sending its next request when
the previous one is done. `--rates 0.5 1 2` then sends the same kind of workload open-loop, as `bench_serving
--request-rate` does in SGLang and vLLM: Poisson arrivals at each rate (requests/s), so queueing shows in TTFT once
the rate passes what the server sustains. Writes one markdown file (date, machine, command, commit, versions, load
average, figures). The 1 and 16 client runs are also the `serve` task of `python -m bench`, for every served stage.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from . import meta
from .adapters import SERVER_STAGES, launch_server
from .meta import ROOT, pct
from .worker import _run_clients, _run_rate, vocab_size
from .workloads import SIZES, serve_workload

DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


def run(stage: str, model: str, quick: bool, rates: list[float], rate_requests: int) -> tuple[list[dict], list[dict]]:
    sizes = SIZES["cpu", quick]
    vocab = vocab_size(model)
    log = Path(tempfile.mkstemp(prefix="bench-serve-", suffix=".log")[1])
    rows, rate_rows = [], []
    with launch_server(stage, model, log, "float32") as url:
        asyncio.run(_run_clients(url, serve_workload(sizes, vocab, 1, seed=7), 1))  # warm-up
        for clients in sizes.serve_clients:
            # a seed of its own per run: the radix cache holds earlier runs' prompts (a repeat skips its prefill)
            w = serve_workload(sizes, vocab, sizes.serve_requests[clients], seed=100 + clients)
            r = asyncio.run(_run_clients(url, w, clients))
            rows.append({**r, "prompt_len": sizes.serve_prompt_len, "output_len": sizes.serve_output_len})
            print(f"{clients:>2} clients: TTFT p50 {statistics.median(r['ttft_s']) * 1e3:.0f} ms, "
                  f"{r['tok_s']:.1f} output tok/s", flush=True)
        for i, rate in enumerate(rates):
            r = asyncio.run(_run_rate(url, serve_workload(sizes, vocab, rate_requests, seed=200 + i), rate))
            rate_rows.append(r)
            print(f"{rate:g} req/s: TTFT p50 {statistics.median(r['ttft_s']) * 1e3:.0f} ms, "
                  f"{r['tok_s']:.1f} output tok/s", flush=True)
    log.unlink(missing_ok=True)
    return rows, rate_rows


def markdown(rows: list[dict], rate_rows: list[dict], stage: str, model: str, info: dict,
             load: tuple[str, str]) -> str:
    lines = [
        "# Online serving on CPU: time to first token and tokens/s",
        "",
        f"- date: {info['date']}",
        f"- machine: {info['hardware']}",
        f"- command: `{info['command']}`",
        f"- server: `python -m {stage} --model {meta.relative(model)} --dtype float32` (defaults otherwise), "
        f"git {info['git']}; {info['versions']}",
        f"- load average (1/5/15 min) at start {load[0]}, at end {load[1]} (a shared machine: figures are noisy)",
        f"- workload: `/v1/completions` streamed, token-id prompts of randint{rows[0]['prompt_len']} tokens, "
        f"{rows[0]['output_len']} output tokens (EOS ignored, greedy); each client sends its next request when the "
        "previous one is done",
        "",
        "| clients | requests | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | per-client tok/s | "
        "output tok/s | wall (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tpot = statistics.median(r["tpot_s"])
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {statistics.median(r['ttft_s']) * 1e3:.0f} | "
            f"{pct(r['ttft_s'], 0.9) * 1e3:.0f} | {tpot * 1e3:.1f} | {1 / tpot:.1f} | {r['tok_s']:.1f} | "
            f"{r['seconds']:.1f} |"
        )
    lines += ["", "TTFT: request sent to first streamed token. TPOT: per-token time of one request after its first "
              "token. Output tok/s: all clients' tokens / wall time.", ""]
    if rate_rows:
        lines += [
            "## Request-rate sweep",
            "",
            f"Open loop: {rate_rows[0]['requests']} requests per rate (the same prompt and output lengths; new "
            "prompts at every rate, so none is served from the radix cache), arriving as a Poisson process (arrival "
            "seed 0); wall = first arrival to last token.",
            "",
            "| request rate (req/s) | requests | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | "
            "TPOT p50 (ms) | output tok/s | wall (s) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rate_rows:
            lines.append(
                f"| {r['rate']:g} | {r['requests']} | {statistics.median(r['ttft_s']) * 1e3:.0f} | "
                f"{pct(r['ttft_s'], 0.99) * 1e3:.0f} | {statistics.median(r['itl_s']) * 1e3:.0f} | "
                f"{pct(r['itl_s'], 0.99) * 1e3:.0f} | {statistics.median(r['tpot_s']) * 1e3:.1f} | "
                f"{r['tok_s']:.1f} | {r['seconds']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", default=SERVER_STAGES[-1], choices=SERVER_STAGES)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    ap.add_argument("--out", type=Path, default=None,
                    help="markdown file to write (default: bench/local/cpu-serve-<stage>.md, gitignored)")
    ap.add_argument("--rates", type=float, nargs="*", default=[], metavar="REQ_PER_S",
                    help="also run a request-rate sweep (Poisson arrivals) at these rates")
    ap.add_argument("--rate-requests", type=int, default=24, help="requests sent at each rate")
    args = ap.parse_args(argv)
    if any(r <= 0 for r in args.rates):
        ap.error("--rates: every rate must be > 0 requests/s")
    out = args.out or meta.LOCAL / f"cpu-serve-{args.stage}{'-quick' if args.quick else ''}.md"
    run_info = meta.run_meta("python -m bench serve", argv)
    load_start = meta.load()
    rows, rate_rows = run(args.stage, args.model, args.quick, args.rates, args.rate_requests)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(rows, rate_rows, args.stage, args.model, run_info, (load_start, meta.load())))
    print(f"wrote {out}")
    return 0
