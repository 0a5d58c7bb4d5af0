"""Where the time of one offline `generate` goes: per step host time vs device time, and a kernel profile.

    python -m bench breakdown --gpu [--options '{"page_size": 16}'] [--json out.json] [--profile-step 200]
                                    [--calls 3]

Runs the offline workload of `python -m bench` (GPU: upstream's 256 requests) through `stage4_fast.LLM` twice:

1. timed: every forward gets CUDA events on the engine stream (device time of the step: graph replay or eager
   launches, sampling included) and host timers around the scheduler's parts (batch preparation, the forward
   call, result processing, and inside it the wait for the step's tokens). Printed per phase and per decode
   batch-size band: steps, tokens, device ms/step, host ms/step, host wait ms/step; overall wall time, device busy
   time and idle time. Overlap scheduling hides host work behind the device only while host < device per step.
   With `--calls N` the same workload runs N times on the same engine, each call timed on its own: call 1 starts
   with an empty prefix cache, the later ones with a warm cache (the state a long-running server is in).
2. profiled: the same run with torch.profiler around a few decode steps at step `--profile-step` (replayed CUDA
   graphs) and the same number of steps run eagerly (graphs switched off for them): kernel time per step by kind
   (GEMM, attention, everything else) and the top kernels.
3. `--host-profile N`: one more run with Python's cProfile around N scheduler loops from `--host-profile-step`
   (default: `--profile-step`) on: the functions that take the host's time per loop (read the ranking and shares).

Every timed run also splits the host's time per scheduler loop by part (receive, admission, prepare, forward call,
process, the prefix cache's inserts, the wait for tokens) for the loops that launch or process a prefill and for
decode loops at batch 129+ (`host_parts`).

The engine is imported as `stage4_fast` from the path (set PYTHONPATH to compare another copy). On CPU (no --gpu)
it runs the CPU workload and skips the device timers and the profile: a smoke test of the instrumentation.

`--stub-forward` (CPU) runs the GPU's workload with the engine's forward replaced by an instant token source
(`bench/stub.py`, default model `models/tiny-qwen3`): the host's part of every loop alone, for working on the
scheduler's batching, prefix cache and bookkeeping without a GPU (`host_parts` per prefill and decode loop).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from . import meta
from .meta import ROOT
from .profiles import report_host_profile, summarize_host_profile, summarize_profile
from .workloads import offline_workload

BANDS = [(1, 32), (33, 128), (129, 256), (257, 1 << 30)]


class _TimedEvent:
    """Stands in for a ForwardOutput's copy_done_event: measures how long the host waits on it."""

    def __init__(self, event, sink: list) -> None:
        self.event, self.sink = event, sink

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        self.event.synchronize()
        self.sink.append(time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self.event, name)


class Instrument:
    def __init__(self, llm, cuda: bool) -> None:
        self.llm, self.cuda = llm, cuda
        self.steps: list[dict] = []
        self.waits: list[float] = []
        self.prepare_s: list[float] = []
        self.process_s: list[float] = []
        self.loop_s: list[float] = []
        self.profile_at: int | None = None
        self.profile_steps = 0
        self.profiles: dict = {}
        self._prof = None
        self.host_profile: cProfile.Profile | None = None  # cProfile around loop iterations [at, at + n)
        self.host_profile_window = (0, 0)
        self.host_profiled_loops = 0
        # host time of each scheduler loop by part (receive, admission, prepare, forward, process, cache_req, wait),
        # with the phases of the batch it launched and the batch it processed
        self.loop_parts: list[dict] = []
        self._parts: dict = defaultdict(float)
        engine = llm.engine
        self._forward, self._prepare = engine.forward_batch, llm._prepare_batch
        self._process, self._loop = llm._process_last_data, llm.overlap_loop
        self._normal_loop, self._can_graph = llm.normal_loop, engine.graph_runner.can_use_cuda_graph
        engine.forward_batch = self.forward_batch
        llm._prepare_batch = self.part("prepare", self.timed(self._prepare, self.prepare_s))
        llm._process_last_data = self.part("process", self.timed(self.processed(self._process), self.process_s))
        llm.receive_msg = self.part("receive", llm.receive_msg)
        llm.prefill_manager.schedule_next_batch = self.part("admission", llm.prefill_manager.schedule_next_batch)
        llm.cache_manager.cache_req = self.part("cache_req", llm.cache_manager.cache_req)
        llm.overlap_loop = self.loop(self.timed(self.host_profiled(self._loop), self.loop_s))
        llm.normal_loop = self.loop(self.timed(self.host_profiled(self._normal_loop), self.loop_s))
        self.eager = False
        engine.graph_runner.can_use_cuda_graph = self.can_use_cuda_graph

    def can_use_cuda_graph(self, batch) -> bool:
        """Graphs off inside the eager profile window. A batch prepared (not padded) while graphs were off and
        run after the window stays eager too."""
        if self.eager or not self._can_graph(batch):
            return False
        padded = getattr(batch, "padded_reqs", None)  # not set yet while pad_batch asks
        return padded is None or len(padded) in self.llm.engine.graph_runner.graph_map

    def part(self, name: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._parts[name] += time.perf_counter() - t0

        return wrapper

    def processed(self, fn):
        def wrapper(last_data, *args, **kwargs):
            if last_data is not None:
                self._parts["processed_phase"] = last_data.fwd_input.batch.phase
            return fn(last_data, *args, **kwargs)

        return wrapper

    def loop(self, fn):
        def wrapper(*args, **kwargs):
            self._parts = defaultdict(float)
            n_steps, n_waits = len(self.steps), len(self.waits)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts = self._parts
                parts["loop"] = time.perf_counter() - t0
                parts["wait"] = sum(self.waits[n_waits:])
                if len(self.steps) > n_steps:
                    parts["forward"] = self.steps[-1]["host_forward_s"]
                    parts["launched_phase"] = self.steps[-1]["phase"]
                    parts["launched_bs"] = self.steps[-1]["bs"]
                self.loop_parts.append(dict(parts))

        return wrapper

    def host_profiled(self, fn):
        def wrapper(*args, **kwargs):
            lo, hi = self.host_profile_window
            if self.host_profile is None or not lo <= len(self.loop_s) < hi:
                return fn(*args, **kwargs)
            self.host_profiled_loops += 1
            self.host_profile.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                self.host_profile.disable()

        return wrapper

    @staticmethod
    def timed(fn, sink: list):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sink.append(time.perf_counter() - t0)

        return wrapper

    def reset(self) -> None:
        for sink in (self.steps, self.waits, self.prepare_s, self.process_s, self.loop_s, self.loop_parts):
            sink.clear()
        self.t_ref = time.perf_counter()  # host and device clocks meet here (the device is idle between runs)
        if self.cuda:
            torch.cuda.synchronize()
            self.allocator_at_start = _allocator_counts()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()

    def _profile_hook(self, index: int, before: bool) -> None:
        """Profile steps [at, at + n) with graphs, then [at + n, at + 2n) eagerly (decode steps only)."""
        at, n = self.profile_at, self.profile_steps
        if at is None or not self.cuda or index < at or index >= at + 2 * n:
            return
        if before and index in (at, at + n):
            self.eager = index == at + n
            torch.cuda.synchronize()
            self._prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
            self._t_prof = time.perf_counter()
        if not before and index in (at + n - 1, at + 2 * n - 1):
            torch.cuda.synchronize()
            wall = time.perf_counter() - self._t_prof
            self._prof.__exit__(None, None, None)
            prof = summarize_profile(self._prof, n, wall)
            rows = self.steps[index - n + 1 : index + 1]
            prof["mean_bs"] = sum(r["bs"] for r in rows) / n
            prof["mean_kv_tokens"] = sum(r["kv"] for r in rows) / n  # KV tokens attended per step (all requests)
            self.profiles["eager" if self.eager else "graph"] = prof
            self.eager, self._prof = False, None

    def forward_batch(self, batch, args, before_sampling=None):
        index = len(self.steps)
        self._profile_hook(index, before=True)
        rec = {"phase": batch.phase, "bs": batch.size, "padded": len(getattr(batch, "padded_reqs", batch.reqs)),
               "tokens": sum(r.extend_len for r in batch.reqs), "kv": sum(r.device_len for r in batch.reqs)}
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
        t0 = time.perf_counter()
        rec["t_launch_s"] = t0 - self.t_ref
        out = self._forward(batch, args, before_sampling)
        rec["host_forward_s"] = time.perf_counter() - t0
        if self.cuda:
            end.record()
            rec["_events"] = (start, end)
        self.steps.append(rec)
        self._profile_hook(index, before=False)
        return out._replace(copy_done_event=_TimedEvent(out.copy_done_event, self.waits))

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            end = _allocator_counts()
            self.allocator = {k: end[k] - self.allocator_at_start.get(k, 0) for k in end}
        prev_end = None
        for rec in self.steps:
            events = rec.pop("_events", None)
            if events is not None:
                rec["device_s"] = events[0].elapsed_time(events[1]) / 1e3
                rec["gap_before_s"] = prev_end.elapsed_time(events[0]) / 1e3 if prev_end is not None else 0.0
                rec["dev_start_s"] = self.ref.elapsed_time(events[0]) / 1e3
                prev_end = events[1]


ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _allocator_counts() -> dict:
    """The CUDA caching allocator's counters: cudaMalloc / cudaFree calls and retries (a cudaFree, or a retry
    after freeing cached blocks, waits for the whole device)."""
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


HOST_PARTS = ("loop", "receive", "admission", "prepare", "forward", "process", "cache_req", "wait")


def host_parts(loops: list[dict]) -> dict:
    """Mean host ms per loop by part, for the loops that launched a prefill, that processed one, and that launched
    a decode batch of 129+ requests (process includes its wait and cache_req; prepare is inside admission's
    caller, not inside admission)."""
    groups = {"launched prefill": [p for p in loops if p.get("launched_phase") == "prefill"],
              "processed prefill": [p for p in loops if p.get("processed_phase") == "prefill"],
              "decode bs 129+": [p for p in loops if p.get("launched_phase") == "decode"
                                 and p.get("processed_phase") == "decode" and p.get("launched_bs", 0) >= 129]}
    return {name: {"loops": len(rows), **{k: 1e3 * sum(r.get(k, 0.0) for r in rows) / max(len(rows), 1)
                                          for k in HOST_PARTS}}
            for name, rows in groups.items()}


def summarize(inst: Instrument, wall: float, output_tokens: int) -> dict:
    steps = inst.steps
    cuda = inst.cuda

    def agg(rows: list[dict]) -> dict:
        n = max(len(rows), 1)
        out = {"steps": len(rows), "tokens_out": sum(r["bs"] for r in rows),
               "mean_bs": sum(r["bs"] for r in rows) / n, "mean_kv": sum(r["kv"] for r in rows) / n,
               "host_forward_ms": 1e3 * sum(r["host_forward_s"] for r in rows) / n,
               "host_interval_ms": 1e3 * sum(r["host_interval_s"] for r in rows) / n}
        if cuda:
            out["device_ms"] = 1e3 * sum(r["device_s"] for r in rows) / n
            out["device_total_s"] = sum(r["device_s"] for r in rows)
            out["gap_ms"] = 1e3 * sum(r["gap_before_s"] for r in rows) / n
        return out

    for i, r in enumerate(steps):  # host time from this launch to the next (what the host spent per step)
        r["host_interval_s"] = steps[i + 1]["t_launch_s"] - r["t_launch_s"] if i + 1 < len(steps) else 0.0
    res = {"wall_s": wall, "output_tokens": output_tokens, "tok_s": output_tokens / wall, "steps": len(steps),
           "host_parts": host_parts(inst.loop_parts),
           "host_loop_total_s": sum(inst.loop_s), "host_wait_total_s": sum(inst.waits),
           "host_prepare_ms": 1e3 * sum(inst.prepare_s) / max(len(inst.prepare_s), 1),
           "host_process_ms": 1e3 * (sum(inst.process_s) - sum(inst.waits)) / max(len(inst.process_s), 1),
           "host_loop_ms": 1e3 * (sum(inst.loop_s) - sum(inst.waits)) / max(len(inst.loop_s), 1),
           "prefill": agg([r for r in steps if r["phase"] == "prefill"]),
           "decode": agg([r for r in steps if r["phase"] == "decode"]), "decode_bands": {}}
    for lo, hi in BANDS:
        rows = [r for r in steps if r["phase"] == "decode" and lo <= r["bs"] <= hi]
        if rows:
            res["decode_bands"][f"{lo}-{hi}"] = agg(rows)
    if cuda:
        res["allocator"] = getattr(inst, "allocator", {})
        res["device_busy_s"] = sum(r["device_s"] for r in steps)
        res["device_idle_s"] = sum(r["gap_before_s"] for r in steps)
        big = sorted(range(len(steps)), key=lambda i: -steps[i]["gap_before_s"])[:8]
        res["largest_gaps"] = [{"step": i, "phase": steps[i]["phase"], "bs": steps[i]["bs"],
                                "gap_ms": 1e3 * steps[i]["gap_before_s"],
                                "prev_host_interval_ms": 1e3 * steps[i - 1]["host_interval_s"] if i else 0.0}
                               for i in big]
        # one compact row per step: phase (1 = prefill), bs, kv tokens, host launch, device start, device ms,
        # host ms in the forward call (a JIT compile or an allocation shows here)
        res["step_rows"] = [[int(r["phase"] == "prefill"), r["bs"], r["kv"], round(1e3 * r["t_launch_s"], 3),
                             round(1e3 * r["dev_start_s"], 3), round(1e3 * r["device_s"], 3),
                             round(1e3 * r["host_forward_s"], 3)] for r in steps]
    return res


def report(name: str, s: dict) -> str:
    lines = [f"== {name}: {s['output_tokens']:,} output tokens in {s['wall_s']:.2f} s = {s['tok_s']:,.0f} tok/s, "
             f"{s['steps']} steps"]
    if "device_busy_s" in s:
        lines.append(f"   device busy {s['device_busy_s']:.2f} s (prefill {s['prefill'].get('device_total_s', 0):.2f}"
                     f" s, decode {s['decode'].get('device_total_s', 0):.2f} s), device idle between steps "
                     f"{s['device_idle_s']:.2f} s; host waited {s['host_wait_total_s']:.2f} s for tokens")
        lines.append("   CUDA allocator: " + ", ".join(f"{k} {v}" for k, v in s.get("allocator", {}).items()))
    lines.append(f"   host per step (without waits): loop {s['host_loop_ms']:.2f} ms = prepare "
                 f"{s['host_prepare_ms']:.2f} + process {s['host_process_ms']:.2f} + forward call + rest")
    for name, g in s.get("host_parts", {}).items():
        lines.append(f"   host ms per loop that {name} ({g['loops']} loops): "
                     + ", ".join(f"{k} {g[k]:.2f}" for k in HOST_PARTS))
    for label, a in [("prefill", s["prefill"]), ("decode", s["decode"])] + [
            (f"decode bs {k}", v) for k, v in s["decode_bands"].items()]:
        dev = f", device {a['device_ms']:.2f} ms/step, gap {a['gap_ms']:.2f} ms" if "device_ms" in a else ""
        lines.append(f"   {label:18s} {a['steps']:5d} steps, mean bs {a['mean_bs']:6.1f}, mean kv/step "
                     f"{a['mean_kv']:9.0f}, host {a['host_interval_ms']:.2f} ms/step (forward call "
                     f"{a['host_forward_ms']:.2f}){dev}")
    slow = sorted(range(len(s.get("step_rows", []))), key=lambda i: -s["step_rows"][i][6])[:5]
    if slow:
        lines.append("   slowest forward calls (host): " + "; ".join(
            f"step {i} ({'prefill' if s['step_rows'][i][0] else 'decode'}, bs {s['step_rows'][i][1]}): "
            f"{s['step_rows'][i][6]:.1f} ms" for i in slow))
    if s.get("largest_gaps"):
        lines.append("   largest device gaps: " + "; ".join(
            f"step {g['step']} ({g['phase']}, bs {g['bs']}): {g['gap_ms']:.1f} ms" for g in s["largest_gaps"]))
    for kind, p in s.get("profiles", {}).items():
        lines.append(f"   profile ({kind}, {p['steps']} steps at bs {p['mean_bs']:.0f}, {p['mean_kv_tokens']:,.0f} KV "
                     f"tokens/step): wall {p['wall_ms_per_step']:.2f} ms/step "
                     f"(profiler on), kernels {p['kernel_us_per_step'] / 1e3:.2f} ms/step in "
                     f"{p['kernels_per_step']:.0f} kernels: "
                     + ", ".join(f"{k} {v['us_per_step'] / 1e3:.2f} ms ({v['calls_per_step']:.0f})"
                                 for k, v in sorted(p["by_kind"].items())))
        if "serial_us" in p:  # each kernel charged from the previous one's end: adds up to the span
            charged = sorted(p["serial_us"].items())
            lines.append("   end to end: " + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in charged)
                         + f", idle {p['idle_us'] / 1e3:.2f} ms per step")
        for k in p["top"][:12]:
            lines.append(f"      {k['us_per_step']:8.1f} us/step {k['calls_per_step']:6.0f}x  {k['kind']:9s} "
                         f"{k['name'][:110]}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench breakdown", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="CUDA, bf16, upstream's 256 requests")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--stage", default="stage4_fast")
    ap.add_argument("--options", default="{}", help="LLM options as JSON")
    ap.add_argument("--seqs", type=int, default=None, help="only the first N requests of the workload")
    ap.add_argument("--profile-step", type=int, default=200, help="first profiled step (of the second run)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="one more run with cProfile around N scheduler steps from --host-profile-step on")
    ap.add_argument("--host-profile-step", type=int, default=None, help="default: --profile-step")
    ap.add_argument("--calls", type=int, default=1, help="timed generate calls on the same engine (2+: warm cache)")
    ap.add_argument("--stub-forward", action="store_true",
                    help="CPU: the GPU's workload with an instant forward (the host's work alone)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main(argv: list[str]) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.stub_forward:
        if args.gpu:
            ap.error("--stub-forward runs on the CPU (its tokens are host tensors)")
        from .stub import install_stub_forward

        install_stub_forward(args.stage)
    default_model = "qwen3-0.6b-shape" if args.gpu else "tiny-qwen3" if args.stub_forward else "SmolLM2-135M-Instruct"
    model = args.model or ROOT / "models" / default_model
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    w = offline_workload(args.gpu or args.stub_forward, False, vocab)
    if args.seqs:
        w = w.head(args.seqs)
    dtype = torch.bfloat16 if args.gpu else torch.float32
    options = json.loads(args.options)
    label = args.label or f"{args.stage} {options or 'default'}"
    t0 = time.perf_counter()
    llm = importlib.import_module(f"{args.stage}.llm").LLM(str(model), dtype=dtype, **options)
    params_cls = importlib.import_module(f"{args.stage}.core").SamplingParams
    params = [params_cls(temperature=0.0, max_tokens=o, ignore_eos=True) for o in w.output_lens]
    llm.generate([[1] * 16], [params_cls(max_tokens=4, ignore_eos=True)], use_tqdm=False)  # warm-up
    print(f"[{label}] engine ready in {time.perf_counter() - t0:.1f} s; module {sys.modules[args.stage].__file__}",
          flush=True)
    inst = Instrument(llm, cuda=args.gpu)
    out: dict = {"meta": meta.run_meta("python -m bench breakdown", argv, gpu=args.gpu), "label": label,
                 "options": options, "workload": w.note, "requests": len(w.prompts)}
    out["calls"] = []
    for call in range(1, args.calls + 1):
        inst.reset()
        t0 = time.perf_counter()
        results = llm.generate(w.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        inst.finish()
        summary = summarize(inst, wall, w.output_tokens)
        summary["wrong_lengths"] = sum(len(r["token_ids"]) != n for r, n in zip(results, w.output_lens))
        summary["prefill_tokens"] = sum(r["tokens"] for r in inst.steps if r["phase"] == "prefill")
        out["calls"].append(summary)
        if call == 1:
            out["timed"] = summary
            out["first_tokens"] = [r["token_ids"][:8] for r in results[:4]]
        name = f"{label} (timed)" if args.calls == 1 else f"{label} (call {call} of {args.calls})"
        print(report(name, summary) + f"\n   prefill tokens computed {summary['prefill_tokens']:,}", flush=True)
    _profile_runs(args, llm, inst, w, params, label, out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    llm.shutdown()
    return 0


def _profile_runs(args: argparse.Namespace, llm, inst: Instrument, w, params: list, label: str, out: dict) -> None:
    """The kernel profile (GPU) and the host profile, each one more run of the workload."""
    if args.gpu and not args.no_profile:
        inst.reset()
        inst.profile_at, inst.profile_steps = args.profile_step, args.profile_steps
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(sys.stderr):
            llm.generate(w.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        inst.finish()
        out["profiled"] = summarize(inst, wall, w.output_tokens)
        out["profiled"]["profiles"] = inst.profiles
        print(report(f"{label} (second run, profiler on for {2 * args.profile_steps} steps)", out["profiled"]),
              flush=True)
    if args.host_profile:
        inst.reset()
        inst.profile_at = None  # no torch.profiler in this run
        at = args.profile_step if args.host_profile_step is None else args.host_profile_step
        inst.host_profile, inst.host_profiled_loops = cProfile.Profile(), 0
        inst.host_profile_window = (at, at + args.host_profile)
        llm.generate(w.prompts, params, use_tqdm=False)
        inst.finish()
        window = inst.steps[at : at + args.host_profile]
        hp = summarize_host_profile(inst.host_profile, max(inst.host_profiled_loops, 1))
        hp["mean_bs"] = sum(r["bs"] for r in window) / max(len(window), 1)
        out["host_profile"] = hp
        inst.host_profile = None
        print(report_host_profile(label, hp), flush=True)
