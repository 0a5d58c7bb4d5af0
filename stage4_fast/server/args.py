"""Server configuration and its command line (flags as upstream)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import List, Tuple

import torch

from ..distributed import DistributedInfo
from ..scheduler.config import SchedulerConfig
from ..utils.hf import cached_load_hf_config, resolve_model_path, tp_split_problem

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class ServerArgs(SchedulerConfig):
    server_host: str = "127.0.0.1"
    server_port: int = 1919
    num_tokenizer: int = 0
    silent_output: bool = False
    served_model_name: str = ""  # the `model` clients must name (not upstream: defaults to --model as given)
    # exposure limits (not upstream): see guard.py; repr=False keeps the key out of any log of the config
    api_key: str | None = field(default=None, repr=False)
    max_request_bytes: int = 1 << 20
    max_queued_requests: int = 1024  # requests waiting beyond the running ones before new ones get 503

    @property
    def share_tokenizer(self) -> bool:
        return self.num_tokenizer == 0

    @property
    def zmq_frontend_addr(self) -> str:
        return "ipc:///tmp/minisgl_3" + self._unique_suffix

    @property
    def zmq_tokenizer_addrs(self) -> List[str]:
        """One address per tokenizer worker. Upstream let the API server PUSH round-robin to all tokenizers, so a
        request's abort could take another worker and reach the scheduler before the request itself; we route
        both by uid to the same worker (``uid % len(addrs)``), which keeps them in order."""
        if self.share_tokenizer:
            return [self.zmq_detokenizer_addr]
        return [f"ipc:///tmp/minisgl_4{self._unique_suffix}.{i}" for i in range(self.num_tokenizer)]

    @property
    def tokenizer_create_addr(self) -> bool:
        return True  # every tokenizer worker binds its own address (see zmq_tokenizer_addrs)

    @property
    def backend_create_detokenizer_link(self) -> bool:
        # shared: the one tokenizer/detokenizer worker binds; otherwise the scheduler binds the detokenizer's
        return not self.share_tokenizer

    @property
    def distributed_addr(self) -> str:
        return f"tcp://127.0.0.1:{self.server_port + 1}"

    @property
    def ipc_paths(self) -> List[str]:
        """Files behind the ipc:// addresses, removed at shutdown (a killed process leaves them behind)."""
        addrs = [self.zmq_backend_addr, self.zmq_detokenizer_addr, self.zmq_scheduler_broadcast_addr,
                 self.zmq_frontend_addr, *self.zmq_tokenizer_addrs]
        return [a.removeprefix("ipc://") for a in addrs if a.startswith("ipc://")]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser(run_shell: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m stage4_fast", description="mini-sglang stage 4: OpenAI-compatible server, fast path"
    )
    p.add_argument("--model-path", "--model", dest="model_path", default=None,
                   help="local model directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                   help="auto = the dtype in the model's config.json (float32 if it names none)")
    p.add_argument("--tensor-parallel-size", "--tp-size", "--tp", dest="tp", type=_positive_int, default=1,
                   help="one scheduler process per rank (NCCL on GPUs, gloo on CPU)")
    p.add_argument("--max-running-requests", dest="max_running_req", type=_positive_int, default=256)
    p.add_argument("--max-seq-len-override", type=_positive_int, default=None)
    p.add_argument("--memory-ratio", type=float, default=0.9)
    p.add_argument("--dummy-weight", dest="use_dummy_weight", action="store_true")
    p.add_argument("--disable-pynccl", dest="use_pynccl", action="store_false")
    p.add_argument("--host", dest="server_host", default="127.0.0.1")
    p.add_argument("--port", dest="server_port", type=int, default=1919)
    p.add_argument("--cuda-graph-max-bs", "--graph", dest="cuda_graph_max_bs", type=int, default=None)
    p.add_argument("--num-tokenizer", "--tokenizer-count", dest="num_tokenizer", type=int, default=0,
                   help="0 = one worker tokenizes and detokenizes")
    p.add_argument("--max-prefill-length", "--max-extend-length", dest="max_extend_tokens", type=_positive_int,
                   default=8192, help="prefill token budget per step (chunk size)")
    p.add_argument("--num-pages", dest="num_page_override", type=_positive_int, default=None)
    p.add_argument("--page-size", type=_positive_int, default=1)
    p.add_argument("--attention-backend", "--attn", dest="attention_backend", default="auto")
    p.add_argument("--cache-type", dest="cache_type", default="radix", choices=["naive", "radix"])
    p.add_argument("--moe-backend", default="auto")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    p.add_argument("--api-key", default=os.environ.get("MINISGL_API_KEY") or None,
                   help="require 'Authorization: Bearer <key>' on every endpoint but /health "
                        "(default: $MINISGL_API_KEY; unset = no auth)")
    p.add_argument("--max-request-bytes", type=_positive_int, default=1 << 20,
                   help="larger request bodies get 413")
    p.add_argument("--max-queued-requests", type=_positive_int, default=1024,
                   help="requests waiting beyond --max-running-requests; more get 503 + Retry-After")
    p.add_argument("--shell-mode", dest="shell", action="store_true", default=run_shell,
                   help="interactive chat in this terminal instead of an HTTP server")
    return p


def _resolve_dtype(model_path: str, name: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    # upstream's help promised this but kept float32; we follow the config
    hf_dtype = getattr(cached_load_hf_config(model_path), "dtype", None) or torch.float32
    return getattr(torch, hf_dtype) if isinstance(hf_dtype, str) else hf_dtype


def parse_args(args: List[str], run_shell: bool = False) -> Tuple[ServerArgs, bool]:
    parser = build_parser(run_shell)
    kwargs = dict(vars(parser.parse_args(args)))
    given_model = kwargs.pop("model_path")
    model_path = resolve_model_path(given_model)
    shell = kwargs.pop("shell")
    tp = kwargs.pop("tp")
    served = kwargs.pop("served_model_name") or given_model or model_path
    if shell:  # one conversation: one request slot, no batching
        kwargs.update(max_running_req=1, cuda_graph_max_bs=1, silent_output=True)
    if tp > 1 and (why := tp_split_problem(model_path, tp)):
        parser.error(f"--tp {tp}: {why}")  # a readable message now, not an assertion in a rank's start-up
    dtype = _resolve_dtype(model_path, kwargs.pop("dtype"))
    server_args = ServerArgs(
        model_path=model_path, tp_info=DistributedInfo(0, tp), dtype=dtype, served_model_name=served, **kwargs
    )
    return server_args, shell
