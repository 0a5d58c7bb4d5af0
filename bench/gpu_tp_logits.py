"""`python -m bench tp-logits`: TP at the logit level, and what the all-reduce costs (2 GPUs).

Free-running bf16 greedy outputs of TP 1 and TP 2 part ways on a random 36-layer model (ties in nearly flat logits
break differently), which cannot tell rounding from a sharding bug. Teacher forcing can: HF bf16 generates greedily,
then HF, stage4 TP 1 and stage4 TP 2 are all fed those same tokens and their logits are compared at every step.
TP 2's distance from HF should be of the same size as TP 1's (two bf16 reduction orders), and argmax should agree
wherever HF's top-2 gap is clear.

Then an NCCL all-reduce micro-benchmark at the hidden size of the model and decode batch sizes: eager and inside a
CUDA graph (as the decode step runs it), in µs per call, so the per-step cost of TP's 2 all-reduces per layer can be
set against a measured decode step.

Each result is appended to ``OUT_DIR/tp_logits.jsonl`` as it comes (the first line: date, command, commit, versions,
machine). On a machine without GPUs the same code runs on the CPU over gloo (a dry run:
``python -m bench tp-logits --model models/tiny-qwen3``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from . import meta
from .meta import ROOT

CLEAR_GAP_OF_STD = 0.05  # a step counts as clear when HF's top-1 leads its top-2 by more than this × the logits' std


def _rank_logits(rank: int, tp: int, addr: str, model: str, inputs: str, result: str) -> None:
    from stage4_fast.distributed import DistributedInfo
    from stage4_fast.tests.teacher_forcing import stage_logits

    data = torch.load(inputs)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    logits = stage_logits(Path(model), data["prompts"], data["forced"], dtype=dtype,
                          tp_info=DistributedInfo(rank, tp), _distributed_addr=addr)
    if rank == 0:
        torch.save(logits, result)


def _spawn_ranks(fn: Callable[..., None], tp: int, *args: object) -> None:
    """``fn(rank, tp, addr, *args)`` in one process per rank, meeting at a fresh port."""
    from stage4_fast.distributed import find_free_port

    mp.spawn(fn, args=(tp, f"tcp://127.0.0.1:{find_free_port()}", *args), nprocs=tp, join=True)


def engine_logits(model: str, tp: int, prompts: list, forced: list, work: Path) -> torch.Tensor:
    """stage4's teacher-forced logits at TP ``tp``: one process per rank, each feeding the same tokens."""
    inputs, result = work / "inputs.pt", work / f"tp{tp}.pt"
    torch.save({"prompts": prompts, "forced": forced}, inputs)
    _spawn_ranks(_rank_logits, tp, model, str(inputs), str(result))
    return torch.load(result)


def compare(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> dict:
    """``a`` against ``b`` (both [prompts, steps, vocab]); which steps are clear is judged on ``ref`` (HF)."""
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
    top2 = ref.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    clear_gap = CLEAR_GAP_OF_STD * ref.std().item()
    clear = gap > clear_gap
    same = a.argmax(-1) == b.argmax(-1)
    return {"max_rel_l2": rel.max().item(), "mean_rel_l2": rel.mean().item(),
            "argmax_equal_all": f"{int(same.sum())}/{same.numel()}",
            "argmax_equal_clear": f"{int(same[clear].sum())}/{int(clear.sum())}", "clear_gap": round(clear_gap, 2),
            # how close the race was wherever the two disagree: HF's top-1 lead over its top-2 there, in logits
            "hf_top2_gap_where_argmax_differs": sorted(round(g, 3) for g in gap[~same].tolist())}


def _rank_allreduce(rank: int, tp: int, addr: str, hidden: int, sizes: list, per_step: int, result: str) -> None:
    import torch.distributed as dist

    from stage4_fast.distributed import DistributedCommunicator

    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=addr, rank=rank, world_size=tp,
                            device_id=device if cuda else None, timeout=timedelta(seconds=60))
    comm, rows = DistributedCommunicator(), []
    dtype = torch.bfloat16 if cuda else torch.float32
    for bs in sizes:
        x = torch.randn(bs, hidden, dtype=dtype, device=device)
        for _ in range(10):
            comm.all_reduce(x)
        iters = 200 if cuda else 10
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        eager_us = (time.perf_counter() - t0) / iters * 1e6
        graph_us = None
        if cuda:  # one decode step's worth of all-reduces captured in one graph, as the engine's graphs hold them
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                comm.all_reduce(x)  # NCCL's lazy set-up must happen outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread queries events while this thread captures (a first attempt with
            # the default "global" mode hung)
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                for _ in range(per_step):
                    comm.all_reduce(x)
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            graph_us = (time.perf_counter() - t0) / (20 * per_step) * 1e6
        rows.append({"batch": bs, "bytes": x.numel() * x.element_size(), "eager_us": round(eager_us, 1),
                     "graph_us": None if graph_us is None else round(graph_us, 1)})
        if rank == 0:
            Path(result).write_text(json.dumps(rows))
            print(json.dumps(rows[-1]), flush=True)
    # not destroy_process_group(): with a captured NCCL graph still alive it hung on the H200s (the rows were all
    # written); a hard exit ends the rank at once, and mp.spawn sees exit code 0
    os._exit(0)


def allreduce_bench(tp: int, hidden: int, sizes: list, per_step: int, work: Path) -> list:
    result = work / "allreduce.json"
    _spawn_ranks(_rank_allreduce, tp, hidden, sizes, per_step, str(result))
    return json.loads(result.read_text())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tp-logits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "qwen3-8b-shape"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--out", type=Path, default=meta.LOCAL / "tp",
                    help="folder for tp_logits.jsonl (default: bench/local/tp)")
    ap.add_argument("--parts", nargs="*", choices=["logits", "allreduce"], default=["logits", "allreduce"])
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "tp_logits.jsonl").open("a")
    name = Path(args.model).name

    def record(rec: dict) -> None:
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(json.dumps(rec), flush=True)

    record({"run": meta.run_meta("python -m bench tp-logits", argv, gpu=torch.cuda.is_available())})
    from transformers import AutoConfig

    from stage4_fast.tests.teacher_forcing import hf_reference

    with tempfile.TemporaryDirectory() as tmp:
        if "logits" in args.parts:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            t0 = time.perf_counter()
            prompts, forced, ref = hf_reference(Path(args.model), args.prompts, args.steps, device=device)
            record({"step": f"{name}: HF bf16 reference", "prompts": len(prompts), "steps": args.steps,
                    "logit_std": ref.std().item(), "seconds": round(time.perf_counter() - t0, 1)})
            logits = {}
            for tp in sorted({1, args.tp}):
                t0 = time.perf_counter()
                logits[tp] = engine_logits(args.model, tp, prompts, forced, Path(tmp))
                record({"step": f"{name}: stage4 TP {tp} vs HF bf16, teacher-forced",
                        **compare(logits[tp], ref, ref), "seconds": round(time.perf_counter() - t0, 1)})
            record({"step": f"{name}: stage4 TP {args.tp} vs TP 1, teacher-forced",
                    **compare(logits[args.tp], logits[1], ref)})
        if "allreduce" in args.parts:
            config = AutoConfig.from_pretrained(args.model)
            per_step = 2 * config.num_hidden_layers  # after attention and after the MLP, in every layer
            rows = allreduce_bench(args.tp, config.hidden_size, args.batches, per_step, Path(tmp))
            record({"step": f"all-reduce over {args.tp} ranks, [batch, {config.hidden_size}] bf16",
                    "per_decode_step": per_step, "rows": rows})
    return 0
