"""`python -m stage4_fast.serve [flags]`: the server with every stage-4 default on — the main way to run this stage.

It takes `python -m stage4_fast`'s flags, every choice on "auto", and prints what "auto" resolved to before starting."""

from __future__ import annotations

import sys
from typing import List

import torch

from .attention import resolve_auto_backend
from .engine.graph import default_graph_bs_list
from .kvcache import kv_cache_dtype_name, resolve_kv_cache_dtype
from .moe import resolve_auto_moe_backend
from .server import ServerArgs, launch_server


def describe(config: ServerArgs) -> str:
    device = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype)
    attn = config.attention_backend
    attn = resolve_auto_backend(device, config.dtype, kv_dtype) if attn == "auto" else attn
    moe = resolve_auto_moe_backend(device) if config.moe_backend == "auto" else config.moe_backend
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    sizes = default_graph_bs_list(device, free, config.cuda_graph_bs, config.cuda_graph_max_bs)
    kind = "CUDA" if device.type == "cuda" else "emulated"
    graphs = f"{kind} graphs up to batch {max(sizes)}" if sizes else "no graphs"
    tp, ranks = config.tp_info.size, config.local_tp_ranks
    where = f"http://{config.server_host}:{config.server_port}"
    if config.api_server_count > 1:
        where += f" ({config.api_server_count} API server processes)"
    if config.nnodes > 1:
        where = (f"node {config.node_rank} of {config.nnodes} (TP ranks {ranks[0]}..{ranks[-1]}), "
                 + (where if config.node_rank == 0 else f"following node 0 at {config.dist_init_addr}"))
    return (f"stage4_fast.serve: {config.model_path} ({str(config.dtype).removeprefix('torch.')}) on {device.type}, "
            f"tp {tp}, attention {attn}, MoE {moe} (MoE models only), {graphs}, page size {config.page_size}, "
            f"KV cache {kv_cache_dtype_name(kv_dtype)}, {where}")


def main(argv: List[str] | None = None) -> None:
    launch_server(argv=sys.argv[1:] if argv is None else argv, announce=describe)


if __name__ == "__main__":
    main()
