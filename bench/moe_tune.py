"""`python -m bench moe-tune --model DIR` (or `--experts E --n N --hidden H --top-k K`): block configs of stage4's
fused MoE kernel per token count, into the file the kernel loads, in SGLang's format and naming
(`benchmark/kernels/fused_moe_triton` there): `stage4_fast/kernel/moe_configs/E=<experts>,N=<intermediate size per
rank>,device_name=<GPU>.json`, mapping each token count to BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages.

Each token count gets the fastest config of a pruned space (`candidates`: BLOCK_M from the rows each expert gets,
a few N/K tiles, warps and pipeline stages; SGLang sweeps thousands, this about fifty, so a sweep takes minutes),
timed as one whole `fused_experts` call (the block alignment and both GEMMs, one config for both, as SGLang)
replayed from a CUDA graph, the way a decode step runs it, on uniformly random routing. The kernel then takes the
config of the nearest tuned token count (`triton_moe.get_moe_config`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

from .meta import ROOT
from .shapes import num_experts

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
CONFIG_DIR = ROOT / "stage4_fast" / "kernel" / "moe_configs"
Config = dict  # BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages (SGLang's keys)


def candidates(tokens: int, experts: int, top_k: int) -> list[Config]:
    """The pruned space for `tokens`: BLOCK_M near the rows each expert gets on average (tokens * top_k / experts;
    a larger block only computes padding), narrow N tiles where few rows make the GEMM a weight stream, 8 warps
    only for the large blocks, GROUP_M > 1 (L2 reuse of a weight tile across row blocks) only with many row blocks."""
    rows = tokens * top_k / experts
    block_m = [16] if rows < 16 else [16, 32] if rows < 64 else [32, 64] if rows < 256 else [64, 128]
    out = []
    for bm in block_m:
        for bn in ([32, 64, 128] if bm == 16 else [64, 128]):
            for bk in (64, 128):
                for warps in ([4] if bm <= 32 else [4, 8]):
                    for stages in (3, 4):
                        out.append({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk,
                                    "GROUP_SIZE_M": 1 if bm <= 32 else 16, "num_warps": warps, "num_stages": stages})
    return out


def kernel_config(config: Config) -> dict:
    """SGLang's keys -> the kernel's launch arguments (as `triton_moe.tuned_configs` reads a file)."""
    return {k.replace("_SIZE", ""): v for k, v in config.items()}


def sweep(buckets: tuple[int, ...], space: Callable[[int], list[Config]], timer: Callable[[int, Config], float],
          budget_s: float = float("inf"), log: Callable[[str], None] = print) -> dict[str, Config]:
    """The fastest config per token count; `timer(tokens, config)` -> seconds, raising for a config that cannot
    run (e.g. its tiles exceed the shared memory). Stops starting new token counts after `budget_s` (the kernel
    takes the nearest tuned count for the rest)."""
    best: dict[str, Config] = {}
    t0 = time.perf_counter()
    for m in buckets:
        if time.perf_counter() - t0 > budget_s:
            log(f"[moe-tune] budget of {budget_s:.0f} s spent: token counts from {m} on not tuned")
            break
        timed = []
        for config in space(m):
            try:
                timed.append((timer(m, config), config))
            except Exception as e:  # noqa: BLE001 - a config the GPU cannot run is skipped, the sweep goes on
                log(f"[moe-tune]   skipped {config}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        if not timed:
            raise RuntimeError(f"no config ran at {m} tokens")
        seconds, config = min(timed, key=lambda t: t[0])
        best[str(m)] = config
        log(f"[moe-tune] {m:5d} tokens: {seconds * 1e6:8.1f} us  {config}  ({len(timed)} configs, "
            f"{time.perf_counter() - t0:.0f} s)")
    return best


def graph_timer(experts: int, n: int, hidden: int, top_k: int, dtype,
                max_tokens: int) -> Callable[[int, Config], float]:
    """A timer of one `fused_experts` call at m tokens: captured once per config into a CUDA graph, then replayed
    for ~20 ms between two events (the first eager call compiles the kernels)."""
    import torch

    from stage4_fast.kernel.triton_moe import fused_experts
    from stage4_fast.moe import fused_topk

    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(experts, 2 * n, hidden, generator=gen, device="cuda", dtype=dtype) / hidden**0.5
    w2 = torch.randn(experts, hidden, n, generator=gen, device="cuda", dtype=dtype) / n**0.5
    x_all = torch.randn(max_tokens, hidden, generator=gen, device="cuda", dtype=dtype)
    logits = torch.randn(max_tokens, experts, generator=gen, device="cuda")
    routing = {}

    def timer(m: int, config: Config) -> float:
        if m not in routing:
            routing[m] = fused_topk(x_all[:m], logits[:m], top_k, True)
        x, (weights, ids) = x_all[:m], routing[m]
        launch = kernel_config(config)

        def fn():
            return fused_experts(x, w1, w2, weights, ids, config=launch)

        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        reps = max(3, min(200, int(20.0 / max(start.elapsed_time(end), 1e-3))))
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        del graph
        return start.elapsed_time(end) / reps / 1e3

    return timer


def shape_of(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(experts, N = intermediate size per rank, hidden, top_k) from --model's config.json or the explicit flags."""
    if args.model:
        cfg = json.loads(Path(args.model, "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        experts, n = num_experts(cfg), cfg["moe_intermediate_size"] // args.tp
        hidden, top_k = cfg["hidden_size"], cfg["num_experts_per_tok"]
    else:
        experts, n, hidden, top_k = args.experts, args.n, args.hidden, args.top_k
    if not all((experts, n, hidden, top_k)):
        raise SystemExit("moe-tune: give --model DIR, or all of --experts --n --hidden --top-k")
    return experts, n, hidden, top_k


def config_path(out: Path, experts: int, n: int, device_name: str) -> Path:
    return out / f"E={experts},N={n},device_name={device_name.replace(' ', '_')}.json"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench moe-tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an MoE model directory (its config.json gives the shape)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size: N = moe_intermediate_size / tp")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--n", type=int, default=None, help="intermediate size per rank (w2's last dimension)")
    ap.add_argument("--hidden", "--k", dest="hidden", type=int, default=None, help="hidden size (GEMM 1's K)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BUCKETS), help="token counts to tune")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="no new token count is started after this many seconds (compiles included)")
    ap.add_argument("--out", type=Path, default=CONFIG_DIR, help=f"folder of the JSON (default: {CONFIG_DIR})")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("moe-tune: needs a CUDA GPU")
    experts, n, hidden, top_k = shape_of(args)
    device_name = torch.cuda.get_device_name()
    print(f"[moe-tune] E={experts} N={n} hidden={hidden} top_k={top_k} bf16 on {device_name}; token counts "
          f"{args.batches}", flush=True)
    timer = graph_timer(experts, n, hidden, top_k, torch.bfloat16, max(args.batches))
    best = sweep(tuple(args.batches), lambda m: candidates(m, experts, top_k), timer, args.budget_s,
                 log=lambda s: print(s, flush=True))
    path = config_path(args.out, experts, n, device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(best, indent=4) + "\n")
    print(f"[moe-tune] written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
