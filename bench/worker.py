"""One engine, one configuration, one process: ``python -m bench worker --stage X --task Y[,Z] --json``.

The parent (`python -m bench`) runs every stage and every ablation configuration through this module in a fresh
process, so global state (a stage's global context, torch's allocator, the peak-memory watermark) never leaks from
one measurement into the next. Engine chatter goes to stderr; stdout carries only the JSON result.

Tasks:
    prefill        tokens/s of one prompt's prefill (time to the first token of a fresh prompt; best of N)
    decode         single-stream decode tokens/s ((n - 1) / (time for n tokens - time for 1 token))
    offline        output tokens/s on the offline workload, plus each request's completion time
    offline_warm   the offline workload three times on the same engine: call 1 with an empty prefix cache, calls
                   2 and 3 with the cache full of the earlier calls' prompts (a long-running server's state)
    serve          stage3+: TTFT / inter-token latency through the HTTP server at 1 and 16 concurrent clients
    serve_offline  stage3+: the offline workload sent to the server all at once (how TP is compared)
    shared_prefix  stage2+: prefill tokens computed and wall time on the shared-prefix workload
    long_prompt    stage2+: a long prompt arrives while others decode: their longest token gap, peak memory
    shape          GPU: the copy rate, offline and 1,024-token decode, each with its memory floor (shapes.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .adapters import (
    ENGINES,
    LLM_STAGES,
    SERVER_STAGES,
    GenResult,
    free_unreferenced_memory,
    launch_server,
    load_adapter,
    shut_down,
    sync,
)
from .meta import relative
from .shapes import task_shape
from .stream_client import DEFAULT_HTTP_CLIENT, HTTP_CLIENTS, open_client, stream_completion
from .workloads import SIZES, Sizes, Workload, offline_workload, random_prompt, serve_workload, shared_prefix

TASKS = ["prefill", "decode", "offline", "offline_warm", "serve", "serve_offline", "shared_prefix", "long_prompt",
         "shape"]
SERVER_ONLY = {"serve", "serve_offline"}  # need no engine in this process


def physical_cores() -> int:
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            return len(os.sched_getaffinity(0))
    return max(1, len(cores))


def vocab_size(model: str) -> int:
    cfg = json.loads(Path(model, "config.json").read_text())
    return cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]


def _check_lengths(res: GenResult, w: Workload) -> int:
    """Requests whose output length differs from what was asked (must be 0: EOS is ignored everywhere)."""
    return sum(len(o) != n for o, n in zip(res.outputs, w.output_lens))


# ---- engine tasks ---------------------------------------------------------------------------------------------------

def task_prefill(adapter, sizes: Sizes, vocab: int) -> dict:
    times = []
    for r in range(sizes.repeats):  # a fresh prompt each time, so no prefix cache can help
        ids = random_prompt(vocab, sizes.prefill_len, seed=1000 + r)
        t0 = time.perf_counter()
        adapter.generate([ids], [1])
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"prompt_tokens": sizes.prefill_len, "seconds": best, "tok_s": sizes.prefill_len / best}


def task_decode(adapter, sizes: Sizes, vocab: int) -> dict:
    n, rates = sizes.decode_len, []
    for r in range(sizes.repeats):
        t0 = time.perf_counter()
        adapter.generate([random_prompt(vocab, 32, seed=2000 + r)], [1])
        t1 = time.perf_counter()
        adapter.generate([random_prompt(vocab, 32, seed=3000 + r)], [n])
        tn = time.perf_counter() - t1
        rates.append((n - 1) / max(tn - (t1 - t0), 1e-9))
    return {"new_tokens": n, "tok_s": max(rates)}


def task_offline(adapter, w: Workload) -> dict:
    t0 = time.perf_counter()
    res = adapter.generate(w.prompts, w.output_lens)
    wall = time.perf_counter() - t0
    return {"workload": w.note, "requests": len(w.prompts), "prompt_tokens": w.prompt_tokens,
            "output_tokens": w.output_tokens, "seconds": wall, "tok_s": w.output_tokens / wall,
            "finish_s": res.finish_s, "wrong_lengths": _check_lengths(res, w),
            "clock_s": [t0, t0 + wall]}  # perf_counter: aligns with the scheduler's MINISGL_STEP_LOG lines


def task_offline_warm(adapter, w: Workload, calls: int = 3) -> dict:
    runs = [task_offline(adapter, w) for _ in range(calls)]
    return {"workload": w.note, "calls_tok_s": [r["tok_s"] for r in runs], "tok_s": runs[0]["tok_s"],
            "wrong_lengths": sum(r["wrong_lengths"] for r in runs)}


def task_shared_prefix(adapter, sizes: Sizes, vocab: int) -> dict:
    """The first request primes the cache (as a first user would), the rest arrive together."""
    w = shared_prefix(vocab, **sizes.prefix)
    adapter.prefill_tokens = 0
    t0 = time.perf_counter()
    first = adapter.generate(w.prompts[:1], w.output_lens[:1])
    rest = adapter.generate(w.prompts[1:], w.output_lens[1:])
    wall = time.perf_counter() - t0
    shared = sizes.prefix["system_len"] * len(w.prompts)
    return {"workload": w.note, "prompt_tokens": w.prompt_tokens, "shared_tokens": shared,
            "prefill_tokens": adapter.prefill_tokens, "seconds": wall,
            "wrong_lengths": _check_lengths(GenResult(first.outputs + rest.outputs, []), w)}


class PeakMemory:
    """Peak memory above a baseline: CUDA's allocator watermark on a GPU, sampled RSS (every ms) on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak, self.base, self._stop = device, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def start(self) -> None:
        """Call at the moment of interest; measures from here on."""
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self.peak = self.rss()
            self._thread.start()

    def stop(self) -> int:
        """Bytes above the baseline at the peak."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def task_long_prompt(adapter, sizes: Sizes, vocab: int, device: torch.device) -> dict:
    """`long_running` short requests decode; once each has 8 tokens, a `long_prompt_len` prompt arrives. Without
    chunked prefill its whole prefill is one step, and every running request waits for it."""
    n = sizes.long_running
    prompts = [random_prompt(vocab, 32, seed=4000 + i) for i in range(n)]
    prompts.append(random_prompt(vocab, sizes.long_prompt_len, seed=5000))
    outs = [sizes.long_running_output] * n + [4]
    mem = PeakMemory(device)

    def release() -> bool:
        ready = all(len(adapter.token_times.get(u, ())) >= 8 for u in range(n))
        if ready:
            mem.start()
        return ready

    released = adapter.hold_back(n, release)
    t0 = time.perf_counter()
    res = adapter.generate(prompts, outs)
    wall = time.perf_counter() - t0
    peak = mem.stop()
    gaps = [b - a for u in range(n) for a, b in zip(adapter.token_times[u], adapter.token_times[u][1:])]
    t_rel = released.get("t", t0)
    return {"long_prompt_tokens": sizes.long_prompt_len, "running": n, "seconds": wall,
            "max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps),
            "long_ttft_s": adapter.token_times[n][0] - t_rel, "peak_mem_bytes": peak,
            "wrong_lengths": sum(len(o) != k for o, k in zip(res.outputs, outs))}


# ---- server tasks ---------------------------------------------------------------------------------------------------

async def _stream_all(url: str, w: Workload, concurrency: int, http_client: str = DEFAULT_HTTP_CLIENT,
                      warm_connections: bool = False,
                      before_clock: Callable[[], Any] | None = None) -> tuple[list[dict], float, float]:
    """`concurrency` clients, each sending its next request as soon as its previous one is done; returns each
    request's figures and the start and end time (perf_counter: one clock for every process of the machine).
    `warm_connections`: the clients' connections open before the clock starts (see `_run_burst`);
    `before_clock`: called after that, right before the clock starts."""
    queue: asyncio.Queue = asyncio.Queue()
    for p, o in zip(w.prompts, w.output_lens):
        queue.put_nowait((p, o))
    results: list[dict] = []
    async with open_client(http_client, concurrency + 4) as client:
        if warm_connections:
            await client.open_connections(url, concurrency)
        if before_clock is not None:
            before_clock()

        async def client_loop() -> None:
            while not queue.empty():
                p, o = queue.get_nowait()
                results.append({**await stream_completion(client, url, p, o), "expected": o})

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return results, t0, time.perf_counter()


async def _run_clients(url: str, w: Workload, concurrency: int, http_client: str = DEFAULT_HTTP_CLIENT,
                       warm_connections: bool = False) -> dict:
    results, t0, t1 = await _stream_all(url, w, concurrency, http_client, warm_connections)
    return {"concurrency": concurrency, "clock_s": [t0, t1], **_summary(results, t1 - t0)}


def _client_process(url: str, w: Workload, start: Any, out: Any, http_client: str, warm_connections: bool) -> None:
    # every client process begins together (one burst), each once its connections are open: no process's clock
    # starts while another still connects
    out.put(asyncio.run(_stream_all(url, w, len(w.prompts), http_client, warm_connections, before_clock=start.wait)))


def burst_client_processes() -> int:
    """A Python client process (one event loop) spends tens of CPU µs per streamed chunk (`python -m bench
    serve-path` reports them), so one process cannot take the ~25k chunks/s a GPU server sends: the burst would
    measure the client. A quarter of the cores, 1 to 4."""
    return max(1, min(4, physical_cores() // 4))


def _run_burst(url: str, w: Workload, processes: int, http_client: str = DEFAULT_HTTP_CLIENT,
               warm_connections: bool = False) -> dict:
    """Every request of `w` at once, spread over `processes` client processes (round robin).

    `warm_connections`: each client opens its keep-alive connection before the clock starts, as a client that
    reuses its connection pool does (`vllm bench serve --num-warmups` leaves its connections open the same way).
    Otherwise each process connects its streams inside the measured time, one after another on its event loop:
    a process sends its first request only once it has started connecting all of them."""
    if processes <= 1:
        return {"client_processes": 1,
                **asyncio.run(_run_clients(url, w, len(w.prompts), http_client, warm_connections))}
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # the parent holds no CUDA state (server jobs load no engine)
    start, out = ctx.Barrier(processes), ctx.Queue()
    parts = [Workload(w.name, w.prompts[i::processes], w.output_lens[i::processes]) for i in range(processes)]
    procs = [ctx.Process(target=_client_process, args=(url, part, start, out, http_client, warm_connections),
                         daemon=True) for part in parts]
    for proc in procs:
        proc.start()
    done = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    results = [r for rs, _, _ in done for r in rs]
    start, end = min(t0 for _, t0, _ in done), max(t1 for _, _, t1 in done)
    return {"concurrency": len(w.prompts), "client_processes": processes, "clock_s": [start, end],
            **_summary(results, end - start)}


async def _run_rate(url: str, w: Workload, rate: float, seed: int = 0) -> dict:
    """Open loop, like SGLang's and vLLM's ``bench_serving --request-rate``: requests arrive as a Poisson process of
    ``rate`` requests/s (seeded exponential gaps) whether or not earlier ones are done."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in w.prompts:
        arrivals.append(t)
        t += rng.expovariate(rate)
    results: list[dict] = []
    async with open_client(DEFAULT_HTTP_CLIENT, len(w.prompts) + 4) as client:
        t0 = time.perf_counter()

        async def send(at: float, p: list[int], o: int) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            results.append({**await stream_completion(client, url, p, o), "expected": o})

        await asyncio.gather(*(send(a, p, o) for a, p, o in zip(arrivals, w.prompts, w.output_lens)))
        wall = time.perf_counter() - t0
    return {"rate": rate, **_summary(results, wall)}


def _summary(results: list[dict], wall: float) -> dict:
    out_tokens = sum(r["tokens"] or 0 for r in results)
    return {"requests": len(results), "seconds": wall, "output_tokens": out_tokens,
            "tok_s": out_tokens / wall, "ttft_s": [r["ttft"] for r in results],
            "itl_s": [g for r in results for g in r["itl"]], "tpot_s": [r["tpot"] for r in results if r["tpot"]],
            "chunks_per_token": sum(r["chunks"] for r in results) / max(out_tokens, 1),
            "wrong_lengths": sum(r["tokens"] != r["expected"] for r in results)}


def task_serve(stage: str, model: str, sizes: Sizes, vocab: int, dtype: str, log: Path, options: dict) -> dict:
    out = {}
    with launch_server(stage, model, log, dtype, **options) as url:
        asyncio.run(_run_clients(url, serve_workload(sizes, vocab, 1, seed=7), 1))  # warm-up
        for c in sizes.serve_clients:
            # a seed of its own per run: the server's radix cache still holds the earlier runs' prompts, and a
            # repeated prompt would skip its prefill (the same seed once gave the 16-client run 4 cached prompts)
            w = serve_workload(sizes, vocab, sizes.serve_requests[c], seed=100 + c)
            out[str(c)] = asyncio.run(_run_clients(url, w, c))
    return out


def task_serve_offline(stage: str, model: str, w: Workload, vocab: int, dtype: str, log: Path,
                       options: dict, http_client: str = DEFAULT_HTTP_CLIENT, warm_connections: bool = True) -> dict:
    with launch_server(stage, model, log, dtype, **options) as url:
        # warm up on a prompt outside the workload (the workload's own first prompt would then come from the cache)
        asyncio.run(_run_clients(url, Workload("warm-up", [random_prompt(vocab, 16, seed=9)], [4]), 1))
        server = server_processes(getattr(url, "pid", None))
        before, ttft_before = cpu_seconds(server), server_ttft_buckets(url)
        r = _run_burst(url, w, burst_client_processes(), http_client, warm_connections)
        # how busy each server process was during the burst: one near 100 % is where the serving path saturates
        busy = {role: (t - before[role]) / max(r["seconds"], 1e-9) for role, t in cpu_seconds(server).items()}
        ttft_buckets = burst_ttft_buckets(url, ttft_before, r["ttft_s"])
    return {"workload": w.note, "seconds": r["seconds"], "output_tokens": r["output_tokens"], "tok_s": r["tok_s"],
            "wrong_lengths": r["wrong_lengths"], "chunks_per_token": r["chunks_per_token"],
            "client_processes": r["client_processes"], "http_client": http_client, "server_cpu_busy": busy,
            "warm_connections": warm_connections,
            "clock_s": r["clock_s"],  # perf_counter: aligns with the scheduler's MINISGL_STEP_LOG lines
            "ttft_buckets": ttft_buckets,
            **{f"{k}_p{q}_s": _quantile(r[f"{k}_s"], q / 100) for k in ("ttft", "itl", "tpot") for q in (50, 99)}}


def server_ttft_buckets(url: str) -> dict[str, int]:
    """The API server's histogram of submit-to-first-reply times (GET /metrics): cumulative count per bucket."""
    import httpx

    out: dict[str, int] = {}
    try:
        reply = httpx.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return out  # (a server without the endpoint gives none either)
    for line in reply.text.splitlines():
        if line.startswith("minisgl_time_to_first_token_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            if le != "+Inf":
                out[le] = int(float(line.rsplit(" ", 1)[1]))
    return out


def burst_ttft_buckets(url: str, server_before: dict[str, int], client_ttft_s: list[float]) -> dict:
    """A burst's time to first token, cumulative counts per bucket (seconds): as the clients saw it (request sent)
    and as the API server did (request submitted to first reply: its histogram since ``server_before``); a gap
    between the two is spent before the server submits (the client, the HTTP intake)."""
    server = {le: n - server_before.get(le, 0) for le, n in server_ttft_buckets(url).items()}
    return {"client": {le: sum(t <= float(le) for t in client_ttft_s) for le in server}, "server": server}


def server_processes(api_server_pid: int | None) -> dict:
    """A launched server's processes by role, psutil processes: the API server (``api_server_pid``, the launched
    ``python -m <stage>``) and its workers under their process titles (``minisgl::scheduler_0``,
    ``minisgl::tokenizer+detokenizer``, ...); empty without a pid or without psutil."""
    if api_server_pid is None:
        return {}
    try:
        import psutil

        api_server = psutil.Process(api_server_pid)
        children = api_server.children(recursive=True)
    except (ImportError, OSError):  # (psutil's errors are OSErrors)
        return {}
    roles = {"api server": api_server}
    for child in children:
        try:
            title = child.cmdline()[:1]
        except OSError:
            continue
        if title and title[0].startswith("minisgl::"):
            roles[title[0].removeprefix("minisgl::")] = child
    return roles


def cpu_seconds(processes: dict) -> dict[str, float]:
    """User + system CPU seconds of each process (by the same keys)."""
    out = {}
    for role, proc in processes.items():
        t = proc.cpu_times()
        out[role] = t.user + t.system
    return out


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


# ---- main -----------------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    tasks = args.task.split(",")
    for t in tasks:
        if t not in TASKS:
            raise SystemExit(f"unknown task {t!r}; one of {TASKS}")
    options = json.loads(args.options)
    device = torch.device("cuda" if args.gpu else "cpu")
    dtype = torch.bfloat16 if args.gpu else torch.float32
    dtype_name = "bfloat16" if args.gpu else "float32"
    sizes = SIZES["gpu" if args.gpu else "cpu", args.quick]
    vocab = vocab_size(args.model)
    threads = physical_cores()
    torch.set_num_threads(threads)  # what the stages pick themselves: hyper-threads do not help GEMMs
    log = Path(args.log or tempfile.mktemp(prefix="bench-server-", suffix=".log"))
    result: dict = {"stage": args.stage, "model": relative(args.model), "options": options,
                    "threads": threads, "device": str(device), "tasks": {}}

    w = offline_workload(args.gpu, args.quick, vocab)
    if args.gpu and sizes.slow_stage_seqs and args.stage == "stage0_tiny":
        w = w.head(sizes.slow_stage_seqs)  # one request at a time through 256 x 1024 tokens would take an hour
    adapter = None

    def engine():
        nonlocal adapter
        if adapter is None:
            t0 = time.perf_counter()
            adapter = load_adapter(args.stage, args.model, device, dtype, **options)
            adapter.generate([random_prompt(vocab, 16, seed=9)], [4])  # warm-up: first touches, allocator, kernels
            result.setdefault("load_s", time.perf_counter() - t0)
        return adapter

    for t in tasks:
        if t in SERVER_ONLY and adapter is not None:
            # the server sizes its KV pool from the GPU memory it finds free: this process's engine gives its own
            # back first (shut down, its last reference dropped, then collected)
            shut_down(adapter)
            adapter = None
            free_unreferenced_memory(device)
        if t == "prefill":
            r = task_prefill(engine(), sizes, vocab)
        elif t == "decode":
            r = task_decode(engine(), sizes, vocab)
        elif t == "offline":
            r = task_offline(engine(), w)
        elif t == "offline_warm":
            r = task_offline_warm(engine(), w)
        elif t == "shared_prefix":
            r = task_shared_prefix(engine(), sizes, vocab)
        elif t == "long_prompt":
            r = task_long_prompt(engine(), sizes, vocab, device)
        elif t == "shape":
            r = task_shape(engine, args.model, w, sizes, vocab)
        elif t == "serve":
            r = task_serve(args.stage, args.model, sizes, vocab, dtype_name, log, options)
        else:
            r = task_serve_offline(args.stage, args.model, w, vocab, dtype_name, log, options, args.http_client,
                                   not args.cold_connections)
        result["tasks"][t] = r
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", required=True, choices=ENGINES, help="engine: hf or a stage package")
    ap.add_argument("--task", required=True, help=f"comma-separated, from {TASKS}")
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--options", default="{}", help="engine options as JSON (SchedulerConfig fields / server flags)")
    ap.add_argument("--quick", action="store_true", help="the reduced sizes of `python -m bench --quick`")
    ap.add_argument("--gpu", action="store_true", help="CUDA, bf16, the GPU workloads")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    ap.add_argument("--log", default=None, help="where a launched server writes its output")
    ap.add_argument("--http-client", choices=HTTP_CLIENTS, default=DEFAULT_HTTP_CLIENT,
                    help="the burst's client library (serve_offline)")
    ap.add_argument("--cold-connections", action="store_true",
                    help="the burst's clients connect inside the measured time (default: before it)")
    args = ap.parse_args(argv)
    if args.stage not in LLM_STAGES and any(t in ("shared_prefix", "long_prompt") for t in args.task.split(",")):
        raise SystemExit(f"{args.stage} has no scheduler: shared_prefix / long_prompt need stage2+")
    if args.stage not in SERVER_STAGES and any(t in SERVER_ONLY for t in args.task.split(",")):
        raise SystemExit(f"{args.stage} has no server: serve tasks need stage3+")
    # engines print progress and logs; keep stdout for the JSON alone
    real_stdout = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    with contextlib.redirect_stdout(sys.stderr):
        result = run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1), file=real_stdout, flush=True)
    return 0
