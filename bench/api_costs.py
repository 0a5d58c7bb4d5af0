"""What the production API's sampling fields cost (stage4): one offline batch with logprobs, echo, penalties, logit
bias, min-p or a JSON-schema grammar, against the same batch without.

    python -m bench api-costs [--model DIR] [--out FILE.md] [--repeats 2] [--num-seqs 8]
    python -m bench api-costs --gpu   # CUDA, bf16, the Qwen3-0.6B shape, 256 requests of 128 output tokens

Workload: `--num-seqs` requests (random.seed(0)), prompts of randint(32, 128) token ids (GPU: randint(128, 512)),
24 output tokens each (GPU: 128), EOS ignored, fp32 (GPU: bf16), stage4's `LLM.generate`. Every variant sets its
field on every request. The grammar variant asks for a JSON array of at least 40 integers, which the output length
does not finish, so it too produces the full output length per request. The variants run in turn, `--repeats`
rounds; each row is its fastest round (the machine is shared). `python -m bench api-host` breaks the grammar's and
the penalties' host work down.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from . import meta

DEFAULT_MODEL = meta.ROOT / "models" / "SmolLM2-135M-Instruct"
GPU_MODEL = meta.ROOT / "models" / "qwen3-0.6b-shape"  # python -m models make qwen3-0.6b-shape --device cuda


@dataclass(frozen=True)
class Setting:
    """Where the costs are measured: the CPU bench's small batch, or a GPU batch of a size a server runs."""

    device: str
    prompt_len: tuple[int, int]
    output_len: int
    num_seqs: int


CPU = Setting("cpu", (32, 128), 24, 8)
GPU = Setting("cuda", (128, 512), 128, 256)
GRAMMAR = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 40})


def variants(vocab_size: int) -> list[tuple[str, str, dict]]:
    """(label, baseline label, SamplingParams fields on top of the baseline's)."""
    bias = [(t, 2.0) for t in range(1000, vocab_size, vocab_size // 16)][:16]  # 16 biased ids per request
    return [
        ("greedy", "greedy", {}),
        ("greedy + logprobs=5", "greedy", {"logprobs": 5}),
        ("greedy + logprobs=20", "greedy", {"logprobs": 20}),
        ("greedy + echo, logprobs=1", "greedy", {"logprobs": 1, "echo": True}),
        ("greedy + presence, frequency, repetition penalties", "greedy",
         {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}),
        ("greedy + logit_bias (16 ids)", "greedy", {"logit_bias": bias}),
        ("greedy + json_schema (xgrammar)", "greedy", {"json_schema": GRAMMAR}),
        ("sampled (T=1, top_p=0.95, seed)", "sampled (T=1, top_p=0.95, seed)", {}),
        ("sampled + min_p=0.05", "sampled (T=1, top_p=0.95, seed)", {"min_p": 0.05}),
    ]


def measure(model: str, repeats: int, setting: Setting) -> dict:
    import torch

    from stage4_fast import LLM, SamplingParams

    from .workloads import offline_cpu

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    w = offline_cpu(vocab, num_seqs=setting.num_seqs, prompt_len=setting.prompt_len,
                    output_len=(setting.output_len, setting.output_len))
    # the naive cache: every round prefills every prompt again, as the first round did
    dtype = torch.bfloat16 if setting.device == "cuda" else torch.float32
    llm = LLM(model, dtype=dtype, cache_type="naive")  # CUDA when there is a GPU
    greedy = SamplingParams(temperature=0.0, max_tokens=setting.output_len, ignore_eos=True)
    bases = {"greedy": greedy, "sampled (T=1, top_p=0.95, seed)": replace(greedy, temperature=1.0, top_p=0.95)}
    llm.generate([list(range(100, 116))], replace(greedy, max_tokens=4), use_tqdm=False)  # warm-up
    rows: dict = {}
    for _ in range(repeats):
        for label, base, fields in variants(vocab):
            params = [replace(bases.get(base, greedy), seed=i if "sampled" in base else None, **fields)
                      for i in range(len(w.prompts))]
            if label == "greedy + json_schema (xgrammar)":
                llm.generate([w.prompts[0]], params[0], use_tqdm=False)  # compile and load xgrammar untimed
            if setting.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            results = llm.generate(w.prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            row = rows.setdefault(label, {"base": base, "seconds": []})
            row["seconds"].append(seconds)
            row["output_tokens"] = sum(len(r["token_ids"]) for r in results)
            row["outputs"] = [r["token_ids"] for r in results]
    llm.shutdown()
    return {"rows": rows, "prompt_tokens": w.prompt_tokens, "threads": torch.get_num_threads(),
            "setting": setting}


def report(res: dict, args: argparse.Namespace, run_info: dict, loads: tuple[str, str], total_s: float) -> str:
    rows, setting = res["rows"], res["setting"]
    gpu = setting.device == "cuda"
    lines = [
        f"# What the production API's sampling fields cost (stage4, {'GPU' if gpu else 'CPU'})",
        "",
        *meta.header_lines(run_info),
        f"- model: {meta.relative(args.model)}, {'bf16' if gpu else 'fp32'}, `LLM.generate`, naive cache; "
        f"{run_info['versions']}" + ("" if gpu else f", {res['threads']} threads"),
        f"- workload: {setting.num_seqs} requests, seed 0, prompts randint{setting.prompt_len} ids "
        f"({res['prompt_tokens']} tokens), {setting.output_len} output tokens each, EOS ignored; every field set on "
        "every request",
        f"- load average (1/5/15 min) before: {loads[0]}, after: {loads[1]}; total {total_s:.0f} s; "
        f"each row: the fastest of {args.repeats} rounds (variants interleaved)",
        "",
        "| variant | output tokens | seconds | output tok/s | vs its baseline | outputs equal the baseline's |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, row in rows.items():
        best = min(row["seconds"])
        base = rows[row["base"]]
        rel = min(base["seconds"]) / best
        equal = sum(a == b for a, b in zip(row["outputs"], base["outputs"]))
        same = "—" if label == row["base"] else f"{equal}/{len(base['outputs'])}"
        lines.append(f"| {label} | {row['output_tokens']} | {best:.2f} | {row['output_tokens'] / best:.1f} | "
                     f"{rel:.2f}× | {same} |")
    lines += [
        "",
        "Logprobs and echo only read the logits (the outputs stay the baseline's); penalties, bias, grammar and "
        "min-p change what is sampled, so their outputs differ by design. vs its baseline > 1 is faster.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench api-costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA, bf16, the Qwen3-0.6B shape, 256 requests")
    ap.add_argument("--model", default=None, help=f"default: {meta.relative(DEFAULT_MODEL)} "
                                                  f"(--gpu: {meta.relative(GPU_MODEL)})")
    ap.add_argument("--out", type=Path, default=None,
                    help="markdown file to write (default: bench/local/{cpu,h200}-api-costs.md, gitignored)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-seqs", type=int, default=None, help=f"default {CPU.num_seqs} (--gpu: {GPU.num_seqs})")
    args = ap.parse_args(argv)
    setting = GPU if args.gpu else CPU
    if args.num_seqs:
        setting = replace(setting, num_seqs=args.num_seqs)
    args.model = args.model or str(GPU_MODEL if args.gpu else DEFAULT_MODEL)
    out = args.out or meta.LOCAL / f"{'h200' if args.gpu else 'cpu'}-api-costs.md"
    run_info = meta.run_meta("python -m bench api-costs", argv, gpu=args.gpu)
    load_start, t0 = meta.load(), time.perf_counter()
    res = measure(args.model, args.repeats, setting)
    text = report(res, args, run_info, (load_start, meta.load()), time.perf_counter() - t0)
    meta.write_report(out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
