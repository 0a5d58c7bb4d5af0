"""Functions run inside spawned TP ranks (gloo on CPU). Importable by the child processes, so not a test module."""

from __future__ import annotations

import io
import os
from typing import Any, Callable, Dict, List

import torch
import torch.multiprocessing as mp


def _entry(rank: int, size: int, addr: str, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    try:
        # serialised to bytes: tensors sent as shared memory would die with this process
        buf = io.BytesIO()
        torch.save(fn(rank, size, addr, *args), buf)
        queue.put((rank, buf.getvalue()))
    except BaseException as e:  # report instead of hanging the parent
        import traceback

        queue.put((rank, f"rank {rank}: {e}\n{traceback.format_exc()}"))


def spawn(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 240.0) -> List[Any]:
    """Run fn(rank, size, addr, *args) in `size` fresh processes; returns every rank's result."""
    from stage4_fast.distributed import find_free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    addr = f"tcp://127.0.0.1:{find_free_port()}"
    procs = [ctx.Process(target=_entry, args=(r, size, addr, fn, args, queue), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    try:
        for _ in range(size):
            rank, value = queue.get(timeout=timeout)
            if isinstance(value, str):
                raise RuntimeError(value)
            results[rank] = torch.load(io.BytesIO(value))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(size)]


def _init(rank: int, size: int, addr: str) -> None:
    from stage4_fast.distributed import DistributedInfo, init_process_group, set_tp_info

    set_tp_info(rank, size)
    init_process_group(DistributedInfo(rank, size), addr, torch.device("cpu"))


def _full_weights(seed: int, shapes: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


LAYER_DIMS = (16, 4, 4, 2, 8, 10, 3)  # hidden, head_dim, q heads, KV heads, intermediate, vocabulary, experts


def _layer_weights() -> Dict[str, torch.Tensor]:
    """The unsharded weights of every layer kind ``tp_layers`` checks (the TP ranks and the reference build the
    same ones from seed 0)."""
    hidden, head_dim, num_q, num_kv, inter, vocab, experts = LAYER_DIMS
    return _full_weights(0, {
        "attn.q_proj.weight": (num_q * head_dim, hidden), "attn.k_proj.weight": (num_kv * head_dim, hidden),
        "attn.v_proj.weight": (num_kv * head_dim, hidden), "attn.q_proj.bias": (num_q * head_dim,),
        "attn.k_proj.bias": (num_kv * head_dim,), "attn.v_proj.bias": (num_kv * head_dim,),
        "attn.o_proj.weight": (hidden, num_q * head_dim),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter), "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        **{f"moe.experts.{e}.{n}.weight": s for e in range(experts)
           for n, s in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)))},
    })


def tp_layers(rank: int, size: int, addr: str) -> Dict[str, torch.Tensor]:
    """Each TP layer built for this rank, loaded with this rank's shard of full weights (the loader's sharding),
    applied to the same input; returns the outputs that must equal the unsharded computation."""
    from stage4_fast.core import Batch, Context, set_global_ctx
    from stage4_fast.distributed import destroy_distributed
    from stage4_fast.layers import (
        LinearColParallelMerged,
        LinearOProj,
        LinearQKVMerged,
        LinearRowParallel,
        MoELayer,
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from stage4_fast.models.weight import _shard_tensor, _stack_experts
    from stage4_fast.moe import TorchMoe

    _init(rank, size, addr)
    from stage4_fast.distributed import DistributedCommunicator

    comm = DistributedCommunicator()
    out: Dict[str, torch.Tensor] = {
        "reduced": comm.all_reduce(torch.full((2, 3), float(rank + 1))),
        "gathered": comm.all_gather(torch.arange(2).float().view(2, 1) + 10 * rank),
    }
    hidden, head_dim, num_q, num_kv, inter, vocab, experts = LAYER_DIMS
    full = _layer_weights()

    def shard(key: str) -> torch.Tensor:
        return _shard_tensor(key, full[key], rank, size, num_kv)

    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))

    qkv = LinearQKVMerged(hidden, head_dim, num_q, num_kv, has_bias=True)
    qkv.load_state_dict({
        "weight": torch.cat([shard(f"attn.{p}_proj.weight") for p in "qkv"]),
        "bias": torch.cat([shard(f"attn.{p}_proj.bias") for p in "qkv"]),
    })
    out["qkv"] = qkv.forward(x)

    o_proj = LinearOProj(num_q * head_dim, hidden, has_bias=False)
    o_proj.load_state_dict({"weight": shard("attn.o_proj.weight")})
    attn_in = torch.randn(5, num_q * head_dim, generator=torch.Generator().manual_seed(2))
    local = attn_in.chunk(size, dim=1)[rank]
    out["o_proj"] = o_proj.forward(local.contiguous())
    # the residual add in the GEMM (the deferred norms' layers): added once over the ranks, written over the input
    residual = torch.randn(5, hidden, generator=torch.Generator().manual_seed(7))
    out["o_proj_add"] = o_proj.forward_add(local.contiguous(), residual)
    assert out["o_proj_add"].data_ptr() == residual.data_ptr()

    gate_up = LinearColParallelMerged(hidden, [inter, inter], has_bias=False)
    gate_up.load_state_dict({"weight": torch.cat([shard("mlp.gate_proj.weight"), shard("mlp.up_proj.weight")])})
    down = LinearRowParallel(inter, hidden, has_bias=False)
    down.load_state_dict({"weight": shard("mlp.down_proj.weight")})
    g, u = gate_up.forward(x).chunk(2, dim=-1)
    out["mlp"] = down.forward(torch.nn.functional.silu(g) * u)

    ids = torch.tensor([0, 3, 9, 7, 2])
    embed = VocabParallelEmbedding(vocab, hidden)
    embed.load_state_dict({"weight": shard("model.embed_tokens.weight")})
    out["embed"] = embed.forward(ids)

    ctx = Context(page_size=1)
    set_global_ctx(ctx)
    head = ParallelLMHead(vocab, hidden)
    head.load_state_dict({"weight": shard("lm_head.weight")})
    with ctx.forward_batch(Batch([], "decode")):
        out["lm_head"] = head.forward(x)

    ctx.moe_backend = TorchMoe()
    moe = MoELayer(experts, 2, hidden, inter)
    pieces = []
    for e in range(experts):
        fused = torch.cat([shard(f"moe.experts.{e}.gate_proj.weight"), shard(f"moe.experts.{e}.up_proj.weight")])
        pieces += [(f"moe.experts.{e}.gate_up_proj.weight", fused),
                   (f"moe.experts.{e}.down_proj.weight", shard(f"moe.experts.{e}.down_proj.weight"))]
    stacked = dict(_stack_experts(iter(pieces), experts))
    moe.load_state_dict({"gate_up_proj": stacked["moe.experts.gate_up_proj"],
                         "down_proj": stacked["moe.experts.down_proj"]})
    router = torch.randn(5, experts, generator=torch.Generator().manual_seed(3))
    out["moe"] = moe.forward(x, router)
    out["x"], out["attn_in"], out["router"] = x, attn_in, router
    destroy_distributed()
    return out


def reference_layers(out: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The same computations without TP (rank 0's inputs)."""
    from stage4_fast.kernel.ref import fused_experts_ref
    from stage4_fast.moe import fused_topk

    hidden, head_dim, num_q, num_kv, inter, vocab, experts = LAYER_DIMS
    full = _layer_weights()
    F = torch.nn.functional
    x, attn_in, router = out["x"], out["attn_in"], out["router"]
    ref = {
        "q": F.linear(x, full["attn.q_proj.weight"], full["attn.q_proj.bias"]),
        "k": F.linear(x, full["attn.k_proj.weight"], full["attn.k_proj.bias"]),
        "v": F.linear(x, full["attn.v_proj.weight"], full["attn.v_proj.bias"]),
        "o_proj": F.linear(attn_in, full["attn.o_proj.weight"]),
        "o_proj_add": torch.randn(5, hidden, generator=torch.Generator().manual_seed(7))
        + F.linear(attn_in, full["attn.o_proj.weight"]),
        "embed": full["model.embed_tokens.weight"][[0, 3, 9, 7, 2]],
        "lm_head": F.linear(x, full["lm_head.weight"]),
    }
    g, u = F.linear(x, full["mlp.gate_proj.weight"]), F.linear(x, full["mlp.up_proj.weight"])
    ref["mlp"] = F.linear(F.silu(g) * u, full["mlp.down_proj.weight"])
    w1 = torch.stack([torch.cat([full[f"moe.experts.{e}.gate_proj.weight"], full[f"moe.experts.{e}.up_proj.weight"]])
                      for e in range(experts)])
    w2 = torch.stack([full[f"moe.experts.{e}.down_proj.weight"] for e in range(experts)])
    weights, ids = fused_topk(x, router, 2, True)
    ref["moe"] = fused_experts_ref(x, w1, w2, weights, ids)
    return ref
