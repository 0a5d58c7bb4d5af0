"""Three measurements of what tiny.py costs; each is an exercise (``python tools/exercises.py start tiny-no-cache``).

    python -m stage0_tiny.measure cache   [--model DIR]   # decode with the KV cache and without it
    python -m stage0_tiny.measure scores  [--model DIR]   # the attention score matrix: shape and bytes
    python -m stage0_tiny.measure threads [--model DIR]   # decode tok/s over torch.set_num_threads(1 .. cores)

The prompt is ``--prompt-tokens`` seeded random token ids: the costs depend on lengths, not on the words.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .tiny import DEFAULT_MODEL, TinyEngine, physical_cores, timed_run


# -- 1. the KV cache ---------------------------------------------------------------------------------------------
def decode_without_cache(engine: TinyEngine, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with no KV cache: every step runs the whole sequence so far (the prompt and the tokens
    generated) through ``engine.forward`` from position 0, with an empty cache. Same tokens as ``engine.generate``,
    but step t computes prompt + t positions where the cached decode computes one."""
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            engine.kv = []  # forget every key and value: they are computed again from the tokens
            token = int(engine.forward(torch.tensor(ids), 0).argmax())
            out.append(token)
            ids.append(token)
    return out


@dataclass
class CacheRace:
    cached: list[int]  # the tokens of engine.generate
    uncached: list[int]  # the tokens of decode_without_cache
    cached_s: float  # seconds, the best of the repeats (prefill included in both)
    uncached_s: float

    @property
    def speedup(self) -> float:
        return self.uncached_s / self.cached_s


def race_cache(engine: TinyEngine, prompt_ids: list[int], steps: int = 16, repeats: int = 3) -> CacheRace:
    """Both decodes on one prompt, in one process, alternating; each time is the best of `repeats` (the run the
    fewest other processes interrupted), so the ratio compares like with like."""
    decoders = {"cached": lambda: engine.generate(prompt_ids, steps),
                "uncached": lambda: decode_without_cache(engine, prompt_ids, steps)}
    times: dict[str, list[float]] = {name: [] for name in decoders}
    tokens: dict[str, list[int]] = {}
    for _ in range(repeats):
        for name, decode in decoders.items():
            t0 = time.perf_counter()
            tokens[name] = decode()
            times[name].append(time.perf_counter() - t0)
    return CacheRace(tokens["cached"], tokens["uncached"], min(times["cached"]), min(times["uncached"]))


# -- 2. the attention score matrix -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScoreMatrix:
    shape: tuple[int, int, int]  # [query heads, query tokens, key tokens]
    bytes: int


def score_matrix(cfg: dict, new_tokens: int, cached_tokens: int, dtype: torch.dtype = torch.float32) -> ScoreMatrix:
    """The scores q·kᵀ of one layer's attention: each query head scores each of the `new_tokens` queries against
    every key, the cached ones and the new ones (GQA repeats the KV heads, so there is one matrix per query head).
    Plain softmax(q kᵀ) v holds all of it at once; fused attention kernels compute it tile by tile instead."""
    shape = (cfg["num_attention_heads"], new_tokens, cached_tokens + new_tokens)
    return ScoreMatrix(shape, math.prod(shape) * dtype.itemsize)


# -- 3. threads --------------------------------------------------------------------------------------------------
@dataclass
class ThreadRun:
    threads: int
    tokens: list[int]
    decode_tps: float


def thread_sweep(engine: TinyEngine, prompt_ids: list[int], new_tokens: int, counts: list[int]) -> list[ThreadRun]:
    """Decode tokens/s with each torch thread count in `counts` (one ThreadRun each, in order); torch's thread count
    is as before afterwards."""
    before = torch.get_num_threads()
    try:
        runs = []
        for n in counts:
            tokens, _, tps = timed_run(engine, prompt_ids, new_tokens, n)
            runs.append(ThreadRun(n, tokens, tps))
        return runs
    finally:
        torch.set_num_threads(before)


def cores() -> int:
    """Physical cores (psutil when installed, else /proc/cpuinfo as tiny.py reads it)."""
    try:
        import psutil

        return psutil.cpu_count(logical=False) or physical_cores()
    except ImportError:
        return physical_cores()


def knee(runs: list[ThreadRun], within: float = 0.1) -> int:
    """The fewest threads that reach (1 - within) of the best decode rate: past it, more threads buy little."""
    best = max(r.decode_tps for r in runs)
    return min(r.threads for r in runs if r.decode_tps >= (1 - within) * best)


def table(runs: list[ThreadRun], physical: int) -> str:
    best = max(r.decode_tps for r in runs)
    rows = [f"{'threads':>7}  {'decode tok/s':>12}"]
    for r in runs:
        mark = "  <- physical cores" if r.threads == physical else ""
        rows.append(f"{r.threads:>7}  {r.decode_tps:>12.1f}  {'#' * round(40 * r.decode_tps / best)}{mark}")
    return "\n".join(rows)


def plot(runs: list[ThreadRun], physical: int, path: Path) -> bool:
    """Save the sweep as a PNG with the physical core count marked; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r.threads for r in runs], [r.decode_tps for r in runs], marker="o")
    ax.axvline(physical, color="gray", linestyle="--", label=f"physical cores ({physical})")
    ax.set(xlabel="torch.set_num_threads", ylabel="decode tok/s", title="stage0_tiny: decode rate over threads")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


# -- python -m stage0_tiny.measure ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stage0_tiny.measure", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["cache", "scores", "threads"])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="HF model directory")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--steps", type=int, default=16, help="tokens to decode")
    ap.add_argument("--plot", type=Path, default=Path("threads.png"), help="threads: the PNG (with matplotlib)")
    args = ap.parse_args(argv)
    engine = TinyEngine(args.model)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.cfg["vocab_size"], (args.prompt_tokens,), generator=gen).tolist()
    if args.what == "cache":
        race = race_cache(engine, prompt, args.steps)
        print(f"{args.steps} tokens after {len(prompt)}: with the KV cache {race.cached_s * 1e3:.1f} ms, without it "
              f"{race.uncached_s * 1e3:.1f} ms ({race.speedup:.1f}x); same tokens: {race.cached == race.uncached}")
    elif args.what == "scores":
        for label, new, cached in (("prefill", len(prompt), 0), ("decode", 1, len(prompt)),
                                   ("prefill", 4096, 0), ("decode", 1, 4096)):
            m = score_matrix(engine.cfg, new, cached)
            print(f"{label:<8} {cached:>5} cached + {new:>5} new tokens: scores {list(m.shape)}, "
                  f"{m.bytes / 2**20:9.3f} MiB per layer (fp32)")
    else:
        runs = thread_sweep(engine, prompt, args.steps, list(range(1, (os.cpu_count() or 1) + 1)))
        physical = cores()
        print(table(runs, physical))
        print(f"knee: {knee(runs)} threads (within 10% of the best); physical cores: {physical}")
        if plot(runs, physical, args.plot):
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
