"""The serving path alone: `python -m stage4_fast` with a model that answers instantly, and a streaming burst.

    python -m bench serve-path [--requests 256] [--output-len 256] [--step-ms 0] [--client-procs 1]

The server runs exactly as `python -m <stage>` does (API server, tokenizer/detokenizer worker, scheduler with its
real batching, prefix cache and messages) except that the engine's forward is replaced by a stub that returns a
token per request in no time (`--step-ms` adds a sleep per step, like a GPU step). What is left is what the
processes between the scheduler and the HTTP stream cost per token: the burst's output tokens per second is the
ceiling the serving path puts on a fast GPU, and each process's CPU seconds per streamed token say where it goes.
The client processes (one asyncio loop each, as `python -m bench`'s server jobs; aiohttp, or httpx with
`--http-client httpx`) are measured too.

Every sampled id is a real token of the model's tokenizer (ids from [100, vocab - 100)), so every token streams
text, and prompts are token ids (no tokenizer work on the way in).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from .stream_client import DEFAULT_HTTP_CLIENT, HTTP_CLIENTS

ROOT = Path(__file__).resolve().parents[1]


# ---- server side (runs in the spawned scheduler process) -------------------------------------------------------------

def _run_stub_scheduler(config, ack_queue, parent_pid: int, stage: str, step_s: float) -> None:
    """The stage's own scheduler process entry (its worker setup, start-up acknowledgement and shutdown), with the
    engine's forward replaced by an instant token source."""
    import importlib

    from .stub import install_stub_forward

    launch = importlib.import_module(f"{stage}.server.launch")  # fresh in this spawned process: the real entry
    install_stub_forward(stage, step_s)
    launch._run_scheduler(config, ack_queue, parent_pid)


def serve(stage: str, argv: list[str], step_s: float) -> None:
    """`python -m <stage>` with the stub scheduler: the launcher looks its scheduler entry up at start time (the
    scheduler process is spawned, so there the stage's entry is the real one again)."""
    import functools
    import importlib

    launch = importlib.import_module(f"{stage}.server.launch")
    launch._run_scheduler = functools.partial(_run_stub_scheduler, stage=stage, step_s=step_s)
    launch.launch_server(argv=argv)


# ---- client side ---------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench serve-path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="stage4_fast", choices=["stage3_served", "stage4_fast"])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(100, 1024))
    ap.add_argument("--step-ms", type=float, default=0.0, help="sleep per scheduler step (a GPU step's time)")
    ap.add_argument("--server-args", default="", help="more flags for the server, e.g. '--page-size 16'")
    ap.add_argument("--client-procs", type=int, default=1, help="client processes the burst is spread over")
    ap.add_argument("--http-client", choices=HTTP_CLIENTS, default=DEFAULT_HTTP_CLIENT, help="the clients' library")
    ap.add_argument("--cold-connections", action="store_true",
                    help="the clients connect inside the measured time (default: before it, as the GPU benchmark)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server subprocess
    return ap


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    if args.serve:
        serve(args.stage, ["--model", args.model, *rest], args.step_ms / 1e3)  # (this parser took --model)
        return 0

    import httpx
    import psutil

    from .worker import (
        _quantile,
        _run_burst,
        _run_clients,
        burst_ttft_buckets,
        cpu_seconds,
        server_processes,
        server_ttft_buckets,
    )
    from .workloads import Workload

    port = 20000 + os.getpid() % 20000
    cmd = [sys.executable, "-m", "bench.serve_path", "--serve", "--stage", args.stage, "--step-ms", str(args.step_ms),
           "--model", args.model, "--port", str(port), *args.server_args.split()]
    if args.stage == "stage4_fast":  # the GPU's backend, for its metadata work (stage3 has the torch backend only)
        cmd += ["--attention-backend", "triton"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_path-{port}.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode} (log: {log.name})")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server not ready (log: {log.name})")
            time.sleep(0.3)
        served_model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
        rng = random.Random(0)

        def prompts(n: int) -> list[list[int]]:
            return [[rng.randint(100, vocab - 100) for _ in range(rng.randint(*args.prompt_len))] for _ in range(n)]
        asyncio.run(_run_clients(url, Workload("warm-up", prompts(4), [8] * 4), 4))
        server = server_processes(proc.pid)  # by process title; the clients: this process and its children
        clients = f"clients ({args.http_client})"

        def cpu() -> dict[str, float]:
            own = psutil.Process().cpu_times()
            return {clients: own.user + own.system + own.children_user + own.children_system, **cpu_seconds(server)}

        before, ttft_before = cpu(), server_ttft_buckets(url)
        w = Workload("burst", prompts(args.requests), [args.output_len] * args.requests)
        r = _run_burst(url, w, args.client_procs, args.http_client, not args.cold_connections)
        after = cpu()
        ttft_buckets = burst_ttft_buckets(url, ttft_before, r["ttft_s"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    tokens = r["output_tokens"]
    res = {"requests": args.requests, "output_len": args.output_len, "step_ms": args.step_ms,
           "http_client": args.http_client, "client_processes": args.client_procs, "served_model": served_model,
           "warm_connections": not args.cold_connections, "server_args": args.server_args, "seconds": r["seconds"],
           "output_tokens": tokens, "tok_s": r["tok_s"],
           "chunks_per_token": r["chunks_per_token"], "wrong_lengths": r["wrong_lengths"],
           "ttft_p50_s": _quantile(r["ttft_s"], 0.5), "ttft_p99_s": _quantile(r["ttft_s"], 0.99),
           "itl_p50_s": _quantile(r["itl_s"], 0.5), "itl_p99_s": _quantile(r["itl_s"], 0.99),
           "cpu_us_per_token": {role: 1e6 * (t - before[role]) / max(tokens, 1) for role, t in after.items()},
           # clock_s: perf_counter, which aligns with the scheduler's MINISGL_STEP_LOG lines
           "ttft_buckets": ttft_buckets, "clock_s": r["clock_s"]}
    _print_result(res, r)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


def _print_result(res: dict, r: dict) -> None:
    tokens = r["output_tokens"]
    print(f"{res['requests']} streams x {res['output_len']} tokens: {tokens:,} tokens in {r['seconds']:.2f} s = "
          f"{r['tok_s']:,.0f} tok/s; chunks/token {r['chunks_per_token']:.2f}; TTFT p50/p99 "
          f"{res['ttft_p50_s'] * 1e3:.0f}/{res['ttft_p99_s'] * 1e3:.0f} ms; wrong lengths {r['wrong_lengths']}")
    for label, us in res["cpu_us_per_token"].items():
        print(f"   {label:28s} {us:7.1f} CPU µs per token")
    for side, counts in res["ttft_buckets"].items():
        print(f"   TTFT <= s, {side:6s}: " + ", ".join(f"{le}: {n}" for le, n in counts.items()))


if __name__ == "__main__":
    sys.exit(main())
