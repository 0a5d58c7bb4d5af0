"""Turn one run's results (the dict `python -m bench` saves as JSON) into the markdown tables and the PNG plots."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable

from .meta import pct
from .shapes import shape_rows

TITLE = "# Benchmark: "  # what a results file written by `python -m bench` starts with
# the served-burst jobs' keys in results written while they were part of the kv group
_OLD_BURST_KEYS = {"abl:kv:burst-offline-auto": "abl:burst:offline", "abl:kv:burst-served-auto": "abl:burst:served",
                   **{f"abl:kv:burst-{k}": f"abl:burst:{k}" for k in ("offline-fp8_e4m3", "served-fp8_e4m3",
                                                                         "served-fp8_e4m3-step16k")}}
LABELS = {"hf": "HF transformers", "stage0_tiny": "stage0_tiny", "stage1_correct": "stage1_correct",
          "stage2_scheduled": "stage2_scheduled", "stage3_served": "stage3_served", "stage4_fast": "stage4_fast"}


def _task(results: dict, key: str, task: str) -> dict | None:
    job = results["jobs"].get(key)
    if not job or "result" not in job:
        return None
    return job["result"]["tasks"].get(task)


def _err(results: dict, key: str) -> str | None:
    job = results["jobs"].get(key)
    return None if job is None else job.get("error")


def _num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:,.{digits}f}" if x < 1000 else f"{x:,.0f}"


def _lat(serve: dict | None, c: str, key: str) -> str:
    if not serve or c not in serve or not serve[c][key]:
        return "–"
    xs = serve[c][key]
    return f"{pct(xs, 0.5) * 1e3:,.0f} / {pct(xs, 0.99) * 1e3:,.0f}"


def stage_table(results: dict) -> str:
    rows = ["| engine | prefill tok/s | decode tok/s (1 stream) | offline out tok/s | vs HF | "
            "TTFT p50/p99 ms, 1 client | ITL p50/p99 ms, 1 client | TTFT p50/p99 ms, 16 clients | "
            "ITL p50/p99 ms, 16 clients | served out tok/s, 16 clients |",
            "|---|" + "---:|" * 9]
    hf = _task(results, "main:hf", "offline")
    for engine in results["engines"]:
        key = f"main:{engine}"
        if key not in results["jobs"]:
            continue
        pre, dec, off = (_task(results, key, t) for t in ("prefill", "decode", "offline"))
        vs = f"{off['tok_s'] / hf['tok_s']:.2f}×" if off and hf else "–"
        off_s = _num(off and off["tok_s"]) + (" ⚠" if off and off["wrong_lengths"] else "")
        if off and off.get("requests") != results["offline_requests"]:
            off_s += f" ({off['requests']} reqs)"
        main = [_num(pre and pre["tok_s"]), _num(dec and dec["tok_s"]), off_s, vs]
        if err := _err(results, key):
            main = [f"error: {err.splitlines()[-1][:80]}", "", "", ""]
        serve = _task(results, f"serve:{engine}", "serve")
        serve_err = _err(results, f"serve:{engine}")
        lat = [_lat(serve, c, k) for c in ("1",) for k in ("ttft_s", "itl_s")]
        lat += [_lat(serve, c, k) for c in ("16",) for k in ("ttft_s", "itl_s")]
        if serve_err:
            lat = [f"error: {serve_err.splitlines()[-1][:60]}", "", "", ""]
        served = _num(serve["16"]["tok_s"]) if serve and "16" in serve else "–"
        rows.append(f"| {LABELS[engine]} | {' | '.join(main)} | {' | '.join(lat)} | {served} |")
    return "\n".join(rows)


def ablation_rows(results: dict) -> list[dict]:
    """One dict per ablation: name, stage, workload, off/on labels and values, effect text, plot data."""
    out: list[dict] = []
    a = results.get("ablation_stage")
    if a is None:
        return out
    jobs = results["jobs"]  # an old key counts only where its new one is absent
    results = {**results, "jobs": {**{_OLD_BURST_KEYS.get(k, k): j for k, j in jobs.items()}, **jobs}}

    def fail(name: str, *keys: str) -> bool:
        errs = [e for k in keys if (e := _err(results, k))]
        if errs:
            out.append({"name": name, "stage": a, "workload": "", "off": "", "on": "",
                        "effect": f"error: {errs[0].splitlines()[-1][:100]}"})
        return bool(errs)

    _radix_and_chunked_rows(results, a, out, fail)

    def throughput(name: str, key_off: str, key_on: str, task: str, lab_off: str, lab_on: str,
                   unit: str = "out tok/s") -> None:
        if fail(name, key_off, key_on):
            return
        x, y = _task(results, key_off, task), _task(results, key_on, task)
        if not (x and y):
            return
        workload = x.get("workload", "")
        if (model := results["jobs"][key_off]["result"].get("model")) and model != results["meta"]["model"]:
            workload += f"; model {model}"
        out.append({"name": name, "stage": results["jobs"][key_off]["stage"], "workload": workload,
                    "off": f"{lab_off}: {x['tok_s']:,.1f} {unit}", "on": f"{lab_on}: {y['tok_s']:,.1f} {unit}",
                    "effect": f"{y['tok_s'] / x['tok_s']:.2f}×",
                    "plot": [(unit.replace("out ", "output "), x["tok_s"], y["tok_s"], lab_off, lab_on)]})

    throughput("overlap scheduling", "abl:overlap:off", "abl:overlap:on", "offline", "off", "on")
    throughput("page size", "abl:page:1", "abl:page:16", "offline", "page 1", "page 16")
    if "abl:graph:off" in results["jobs"]:
        emulated = results["meta"].get("device") == "cpu"
        throughput("CUDA graph (CPU: emulated)" if emulated else "CUDA graph", "abl:graph:off", "abl:graph:on",
                   "offline", "off", "on")
        x, y = _task(results, "abl:graph:off", "decode"), _task(results, "abl:graph:on", "decode")
        if x and y:
            out[-1]["effect"] += f"; single-stream decode {x['tok_s']:,.0f} → {y['tok_s']:,.0f} tok/s"
    if "abl:graph:prefill-off" in results["jobs"]:
        throughput("prefill CUDA graph", "abl:graph:prefill-off", "abl:graph:prefill-on", "prefill", "eager",
                   "graphs", unit="prefill tok/s")
    if "abl:attn:triton" in results["jobs"]:
        throughput("attention backend", "abl:attn:triton", "abl:attn:fi", "offline", "triton", "fi")
    if "abl:kv:auto" in results["jobs"]:
        throughput("KV cache dtype", "abl:kv:auto", "abl:kv:fp8_e4m3", "offline", "bf16 (auto)", "fp8_e4m3")
    if "abl:kv:fp8_e4m3-calculated" in results["jobs"]:
        throughput("fp8 KV scales", "abl:kv:fp8_e4m3", "abl:kv:fp8_e4m3-calculated", "offline", "scale 1.0",
                   "--calculate-kv-scales")
    if "abl:burst:served-fp8_e4m3" in results["jobs"]:
        throughput("KV cache dtype (server burst)", "abl:burst:served", "abl:burst:served-fp8_e4m3",
                   "serve_offline", "bf16 (auto)", "fp8_e4m3")
    if "abl:tp:1" in results["jobs"]:
        throughput("tensor parallel (server)", "abl:tp:1", "abl:tp:2", "serve_offline", "TP 1", "TP 2")
    for name, label in (("radix", "radix cache, page 1"), ("page16", "radix cache, page 16"),
                        ("naive", "naive cache")):
        key = f"abl:warm:{name}"
        if key not in results["jobs"] or fail(f"warm cache ({label})", key):
            continue
        if (r := _task(results, key, "offline_warm")) is None:
            continue
        cold, *warm = r["calls_tok_s"]
        out.append({"name": f"warm cache ({label})", "stage": results["jobs"][key]["stage"],
                    "workload": r["workload"] + "; the same prompts again on the same engine",
                    "off": f"call 1 (cold): {cold:,.0f} out tok/s",
                    "on": "calls " + ", ".join(str(i + 2) for i in range(len(warm))) + " (warm): "
                          + " / ".join(f"{x:,.0f}" for x in warm),
                    "effect": " / ".join(f"{x / cold - 1:+.1%}" for x in warm),
                    "plot": [("output tok/s", cold, warm[0], "call 1", "call 2")]})
    _served_burst_rows(results, out, fail)
    shape_rows(results, out, fail)
    return out


def _radix_and_chunked_rows(results: dict, a: str, out: list[dict], fail: Callable[..., bool]) -> None:
    """The radix cache's and chunked prefill's rows: prefill tokens saved, decode stalls and peak memory."""
    off, on = _task(results, "abl:radix:off", "shared_prefix"), _task(results, "abl:radix:on", "shared_prefix")
    if not fail("radix cache", "abl:radix:off", "abl:radix:on") and off and on:
        saved = off["prefill_tokens"] - on["prefill_tokens"]
        out.append({"name": "radix cache", "stage": a, "workload": off["workload"],
                    "off": f"naive: {off['prefill_tokens']:,} prefill tokens, {off['seconds']:.2f} s",
                    "on": f"radix: {on['prefill_tokens']:,} prefill tokens, {on['seconds']:.2f} s",
                    "effect": f"{saved:,} prefill tokens saved = {saved / on['shared_tokens']:.0%} of the shared "
                              f"prefix tokens; {off['seconds'] / on['seconds']:.2f}× faster",
                    "plot": [("prefill tokens computed", off["prefill_tokens"], on["prefill_tokens"], "naive", "radix"),
                             ("wall time (s)", off["seconds"], on["seconds"], "naive", "radix")]})
    off, on = _task(results, "abl:chunked:off", "long_prompt"), _task(results, "abl:chunked:on", "long_prompt")
    if not fail("chunked prefill", "abl:chunked:off", "abl:chunked:on") and off and on:
        mb = 1 << 20
        chunk = results["jobs"]["abl:chunked:on"]["options"]["max_extend_tokens"]
        out.append({"name": "chunked prefill", "stage": a,
                    "workload": f"{off['long_prompt_tokens']}-token prompt arrives while {off['running']} "
                                f"requests decode",
                    "off": f"one-step prefill: max decode stall {off['max_gap_s'] * 1e3:,.0f} ms, peak memory "
                           f"+{off['peak_mem_bytes'] / mb:,.0f} MB",
                    "on": f"chunks of {chunk}: max decode stall {on['max_gap_s'] * 1e3:,.0f} ms, peak memory "
                          f"+{on['peak_mem_bytes'] / mb:,.0f} MB",
                    "effect": f"stall {off['max_gap_s'] / on['max_gap_s']:.1f}× shorter, peak memory "
                              f"{off['peak_mem_bytes'] / max(on['peak_mem_bytes'], 1):.1f}× lower; long prompt's "
                              f"TTFT {off['long_ttft_s']:.2f} s → {on['long_ttft_s']:.2f} s",
                    "plot": [("max decode stall (ms)", off["max_gap_s"] * 1e3, on["max_gap_s"] * 1e3, "off",
                              f"chunk {chunk}"),
                             ("peak memory above baseline (MB)", off["peak_mem_bytes"] / mb, on["peak_mem_bytes"] / mb,
                              "off", f"chunk {chunk}")]})


def _served_burst_rows(results: dict, out: list[dict], fail: Callable[..., bool]) -> None:
    def served_burst(name: str, key_offline: str, key_served: str) -> None:
        """The whole workload at once through the server against offline on the same model."""
        if key_served not in results["jobs"] or fail(name, key_offline, key_served):
            return
        x, y = _task(results, key_offline, "offline"), _task(results, key_served, "serve_offline")
        if not (x and y):
            return
        ms = {k: (y.get(k) or 0.0) * 1e3 for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                                                     "tpot_p50_s", "tpot_p99_s")}
        out.append({"name": name, "stage": "stage4_fast",
                    "workload": f"{y['workload']}, all at once as streamed /v1/completions "
                                f"({y.get('client_processes', 1)} client processes"
                                + (", connections open before the clock" if y.get("warm_connections") else "")
                                + "); model "
                                f"{results['jobs'][key_served]['result']['model']}",
                    "off": f"offline `LLM.generate`: {x['tok_s']:,.0f} out tok/s",
                    "on": f"server: {y['tok_s']:,.0f} out tok/s; TTFT p50/p99 {ms['ttft_p50_s']:,.0f} / "
                          f"{ms['ttft_p99_s']:,.0f} ms, ITL p50/p99 {ms['itl_p50_s']:,.1f} / "
                          f"{ms['itl_p99_s']:,.1f} ms, TPOT p50/p99 {ms['tpot_p50_s']:,.1f} / "
                          f"{ms['tpot_p99_s']:,.1f} ms, {y['chunks_per_token']:.2f} chunks per token"
                          + _busy(y.get("server_cpu_busy")),
                    "effect": f"{y['tok_s'] / x['tok_s']:.0%} of offline",
                    "plot": [("output tok/s", x["tok_s"], y["tok_s"], "offline", "served")]})

    served_burst("served burst", "abl:burst:offline", "abl:burst:served")
    served_burst("served burst, fp8_e4m3 KV", "abl:burst:offline-fp8_e4m3", "abl:burst:served-fp8_e4m3")
    if (step := results["jobs"].get("abl:burst:served-fp8_e4m3-step16k")) is not None:
        served_burst(f"served burst, fp8_e4m3 KV, `--max-num-batched-tokens {step['options']['max_extend_tokens']}`",
                     "abl:burst:offline-fp8_e4m3", "abl:burst:served-fp8_e4m3-step16k")


def _busy(busy: dict | None) -> str:
    """The server processes' CPU during a burst, e.g. "; CPU busy: api server 71 %, scheduler_0 98 %"."""
    if not busy:
        return ""
    return "; CPU busy: " + ", ".join(f"{role} {share:.0%}" for role, share in sorted(busy.items()))


def ablation_table(rows: list[dict]) -> str:
    lines = ["| ablation | stage | workload | off | on | effect |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['stage']} | {r['workload']} | {r['off']} | {r['on']} | {r['effect']} |"
              for r in rows]
    return "\n".join(lines)


# ---- plots ----------------------------------------------------------------------------------------------------------

def plot_all(results: dict, out_dir: Path, prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    engines = [e for e in results["engines"] if f"main:{e}" in results["jobs"] and not _err(results, f"main:{e}")]
    labels = [LABELS[e].replace("_", "\n", 1) for e in engines]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (task, title) in zip(axes, [("prefill", "prefill tok/s"), ("decode", "single-stream decode tok/s"),
                                        ("offline", "offline output tok/s")]):
        vals = [(_task(results, f"main:{e}", task) or {}).get("tok_s", 0.0) for e in engines]
        bars = ax.bar(range(len(engines)), vals, color=["#888"] + ["#3b7dd8"] * (len(engines) - 1))
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(engines)), labels, fontsize=8)
        ax.set_title(title)
    fig.suptitle(f"throughput by stage — {results['meta']['summary']}", fontsize=9)
    fig.tight_layout()
    written.append(_save(fig, out_dir / f"{prefix}_throughput.png"))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for e in engines:
        off = _task(results, f"main:{e}", "offline")
        if off:
            _cdf(ax, off["finish_s"], "-", LABELS[e])
    ax.set(title="offline workload: request completion time", xlabel="seconds since start", ylabel="CDF")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    for ax, key, title in ((axes[1], "ttft_s", "server TTFT"), (axes[2], "itl_s", "server inter-token latency")):
        for e in results["engines"]:
            serve = _task(results, f"serve:{e}", "serve")
            for c, style in (("1", "-"), ("16", "--")):
                if serve and c in serve and serve[c][key]:
                    _cdf(ax, [x * 1e3 for x in serve[c][key]], style,
                         f"{LABELS[e]}, {c} client{'s' if c != '1' else ''}")
        ax.set(title=title, xlabel="ms", ylabel="CDF")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no server stage in this run", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    written.append(_save(fig, out_dir / f"{prefix}_latency.png"))

    panels = [(r, p) for r in ablation_rows(results) for p in r.get("plot", [])]
    if panels:
        cols = min(4, len(panels))
        rows_ = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows_, cols, figsize=(3.4 * cols, 3.6 * rows_), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.axis("off")
        for ax, (r, (metric, a, b, la, lb)) in zip(axes.flat, panels):
            bars = ax.bar([0, 1], [a, b], color=["#888", "#3b7dd8"])
            ax.bar_label(bars, fmt="%.4g", fontsize=8)
            ax.set_xticks([0, 1], [la, lb], fontsize=8)
            ax.set_title(textwrap.fill(r["name"], 40) + f"\n({r['stage']})", fontsize=9)
            ax.set_ylabel(metric, fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{prefix}_ablations.png"))
    return written


def _cdf(ax, values: list[float], style: str, label: str) -> None:
    xs = sorted(values)
    ax.step([0.0, *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], style, where="post", label=label)


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def markdown(results: dict, images: list[str]) -> str:
    m = results["meta"]
    sizes = results["sizes"]
    lines = [f"{TITLE}{m['machine']}{' (quick mode)' if m['quick'] else ''}", "",
             f"- date: {m['date']}; total {m['total_s'] / 60:.1f} min",
             f"- command: `{m['command']}`",
             f"- machine: {m['hardware']}; load average (1/5/15 min) {m['load_before']} at start, {m['load_after']} "
             "at end (the end value includes this run's own threads)"
             + (f" — **{m['load_note']}**" if m.get("load_note") else ""),
             f"- other processes used {m['foreign_cpu']:.0%} of the CPUs during the run"
             + (f"; more than 15 % during: {', '.join(m['busy_jobs'])} (those numbers are the least reliable)"
                if m["busy_jobs"] else "")
             + (f"; measured twice because the first run was busy, the quieter kept: {', '.join(m['reruns'])}"
                if m.get("reruns") else ""),
             f"- versions: {m['versions']}; git {m['git']}",
             f"- model: `{m['model']}` ({m['dtype']}), device {m['device']}, {m['threads']} torch threads per process",
             ""]
    if m["quick"]:
        lines += ["**Quick mode: every workload is reduced (sizes below); compare rows with each other, not with "
                  "the full run.**", ""]
    lines += ["## Stages", "", stage_table(results), "",
              f"- prefill: one fresh {sizes['prefill_len']}-token prompt to its first token, best of "
              f"{sizes['repeats']}; decode: a 32-token prompt, ({sizes['decode_len']} − 1) tokens / (time for "
              f"{sizes['decode_len']} tokens − time for 1), best of {sizes['repeats']}",
              f"- offline: {results['offline_workload']}, EOS ignored, output tokens / wall time of one `generate` "
              "call. HF: one left-padded batch decoded to the longest output (only the requested tokens count); "
              "stage0: one request after another; stage1: one static batch; stage2+: continuous batching.",
              # runs before the client was recorded used httpx
              f"- server: `/v1/completions` streamed ({results.get('http_client', 'httpx')}), token-id prompts "
              f"randint{tuple(sizes['serve_prompt_len'])}, {sizes['serve_output_len']} output tokens, greedy, EOS "
              "ignored; "
              + ", ".join(f"{c} client{'s' if c != '1' else ''}: {n} requests" for c, n in
                          results["serve_requests"].items())
              + "; ITL = gaps between streamed chunks",
              "- each engine runs in its own process (`python -m bench worker`); ⚠ = an output length differed",
              ""]
    if results["skipped"]:
        lines += ["Skipped: " + "; ".join(results["skipped"]), ""]
    rows = ablation_rows(results)
    lines += ["## Ablations", ""]
    if rows:
        lines += [ablation_table(rows), "",
                  "Each configuration ran in its own process, the two of a row one right after the other. "
                  "Peak memory: RSS sampled every ms above the level when "
                  "the long prompt arrived (CPU), or the CUDA allocator's peak (GPU).", ""]
    else:
        lines += ["No ablation ran (needs stage2 or later).", ""]
    if results.get("ablation_notes"):
        lines += ["Not run: " + "; ".join(results["ablation_notes"]), ""]
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in images] + ["", f"Raw numbers: `{m['json']}`.", ""]
    return "\n".join(lines)
