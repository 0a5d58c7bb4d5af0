"""Server configuration, built from the command line (`cli.py`) and the start-up checks (`preflight.py`)."""

from __future__ import annotations

import logging
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Tuple

import torch

from ..attention import kv_cache_dtype_problem
from ..distributed import DistributedInfo
from ..kvcache import is_fp8, resolve_kv_cache_dtype
from ..scheduler.config import SchedulerConfig
from ..utils.hf import cached_load_hf_config, tp_split_problem
from .cli import DTYPES, build_parser, prog_name
from .preflight import StartupError, check_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerArgs(SchedulerConfig):
    server_host: str = "127.0.0.1"
    server_port: int = 1919
    num_tokenizer: int = 0
    silent_output: bool = False
    served_model_name: str = ""  # the model id of /v1/models (not upstream; see parse_args for the default)
    model_aliases: Tuple[str, ...] = ()  # other ids requests may name: the path given to --model, the resolved one
    log_level: str = "info"
    log_level_http: str | None = None  # uvicorn's loggers (SGLang's flag); None = log_level
    access_log: bool = True  # uvicorn's line per request (vLLM's --disable-uvicorn-access-log turns it off)
    log_requests: bool = False  # a line per request received and ended (request_log.py)
    max_log_len: int | None = None  # prompt characters or token ids such a line shows (None: all)
    tool_call_parser: str | None = None  # how tool_choice auto finds calls in the output (tool_calls.py)
    reasoning_parser: str | None = None  # how a thinking block is read out into reasoning_content (reasoning.py)
    # exposure limits (not upstream): see guard.py; repr=False keeps the key out of any log of the config
    api_key: str | None = field(default=None, repr=False)
    max_request_bytes: int = 1 << 20
    max_queued_requests: int = 1024  # requests waiting beyond the running ones before new ones get 503
    # longer than clients keep an idle connection (httpx 5 s, aiohttp 15 s), so the client drops it first: at
    # uvicorn's 5 s a request can race the server closing the connection and be lost
    timeout_keep_alive: int = 60
    api_server_count: int = 1  # HTTP server processes on one port (see launch.py)
    # one model over several machines (SGLang's flags): this machine's index and node 0's "host:port"
    node_rank: int = 0
    dist_init_addr: str | None = None

    @property
    def model_ids(self) -> Tuple[str, ...]:
        """Every id a request's `model` may name; the first is the one /v1/models lists."""
        return (self.served_model_name, *self.model_aliases)

    @property
    def effective_log_level(self) -> str:
        return "warning" if self.silent_output and self.log_level in ("debug", "info") else self.log_level

    @property
    def http_log_level(self) -> str:
        return self.log_level_http or self.effective_log_level

    @property
    def share_tokenizer(self) -> bool:
        return self.num_tokenizer == 0

    @property
    def zmq_frontend_addr(self) -> str:
        return "ipc:///tmp/minisgl_3" + self._unique_suffix

    @property
    def zmq_frontend_addrs(self) -> List[str]:
        """Where each API server process receives its replies; the workers route a reply by ``uid % count``."""
        first = self.zmq_frontend_addr
        return [first, *(f"{first}.{i}" for i in range(1, self.api_server_count))]

    @property
    def zmq_tokenizer_addrs(self) -> List[str]:
        """One address per tokenizer worker; a request and its abort take the same one (by uid), so stay in order."""
        if self.share_tokenizer:
            return [self.zmq_detokenizer_addr]
        return [f"ipc:///tmp/minisgl_4{self._unique_suffix}.{i}" for i in range(self.num_tokenizer)]

    @property
    def backend_create_detokenizer_link(self) -> bool:
        # shared: the one tokenizer/detokenizer worker binds; otherwise the scheduler binds the detokenizer's
        return not self.share_tokenizer

    @property
    def distributed_addr(self) -> str:
        return f"tcp://{self.dist_init_addr or f'127.0.0.1:{self.server_port + 1}'}"

    @property
    def zmq_scheduler_broadcast_addr(self) -> str:
        if self.nnodes == 1:
            return super().zmq_scheduler_broadcast_addr
        host, port = split_host_port(self.dist_init_addr or "")
        return f"tcp://{socket.gethostbyname(host)}:{port + 1}"  # rank 0 binds it on node 0; the others connect

    @property
    def node_link_addr(self) -> Tuple[str, int]:
        """Where the machines' launchers meet (node 0's launcher hosts the store): see ``nodes.py``."""
        host, port = split_host_port(self.dist_init_addr or "")
        return host, port + 2

    @property
    def local_tp_ranks(self) -> range:
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def ipc_paths(self) -> List[str]:
        """Files behind the ipc:// addresses, removed at shutdown (a killed process leaves them behind)."""
        addrs = [self.zmq_backend_addr, self.zmq_detokenizer_addr, self.zmq_scheduler_broadcast_addr,
                 *self.zmq_frontend_addrs, *self.zmq_tokenizer_addrs]
        return [a.removeprefix("ipc://") for a in addrs if a.startswith("ipc://")]


def split_host_port(addr: str) -> Tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65533:
        raise ValueError(f"{addr!r} is not HOST:PORT (PORT, PORT+1 and PORT+2 are used on node 0)")
    return host, int(port)


def _multi_node_problem(tp: int, nnodes: int, node_rank: int, dist_init_addr: str | None) -> str | None:
    if not node_rank < nnodes:
        return f"--node-rank {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})"
    if tp % nnodes:
        return f"--tp {tp} (the total rank count) does not split evenly over --nnodes {nnodes}"
    if dist_init_addr is None:
        return "--dist-init-addr HOST:PORT (node 0's address) is required with --nnodes > 1" if nnodes > 1 else None
    try:
        host, _ = split_host_port(dist_init_addr)
        socket.gethostbyname(host)
    except (ValueError, OSError) as e:
        return f"--dist-init-addr {dist_init_addr}: {e}"
    return None


def _resolve_dtype(model_path: str, name: str) -> torch.dtype:
    if DTYPES[name] is not None:
        return DTYPES[name]
    # upstream's help promised this but kept float32; we follow the config
    hf_dtype = getattr(cached_load_hf_config(model_path), "dtype", None) or torch.float32
    return getattr(torch, hf_dtype) if isinstance(hf_dtype, str) else hf_dtype


def _model_ids(given: str | None, model_path: str, served: str | None) -> Tuple[str, Tuple[str, ...]]:
    """The served id (the model directory's name, or the hub id as given) and its aliases (the paths)."""
    if served is None:
        hub_id = given is not None and not Path(given).expanduser().is_dir()
        served = given if hub_id else Path(model_path).resolve().name
    aliases = [a for a in (given, model_path, str(Path(model_path).resolve())) if a]
    return served, tuple(dict.fromkeys(a for a in aliases if a != served))


def parse_args(args: List[str], run_shell: bool = False, prog: str | None = None) -> Tuple[ServerArgs, bool]:
    """The command line -> (ServerArgs, shell?). A bad flag or model ends the process with one line (exit code 2)."""
    parser = build_parser(run_shell, prog or prog_name())
    kwargs = dict(vars(parser.parse_args(args)))
    given_model = kwargs.pop("model_path")
    if kwargs.pop("enable_auto_tool_choice") and kwargs["tool_call_parser"] is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (the format the calls are read in)")
    for flag in ("tool_call_parser", "reasoning_parser"):
        if kwargs["shell"] and kwargs[flag] is not None:  # the shell prints the model's text as it comes
            parser.error(f"--{flag.replace('_', '-')}: the shell reads no tool calls or reasoning out of the output")
    if kwargs.pop("load_format") == "dummy":
        kwargs["use_dummy_weight"] = True
    if kwargs.pop("trust_remote_code"):
        logger.warning("--trust-remote-code has no effect: only this engine's own model code runs")
    try:
        model_path = check_model(given_model, needs_weights=not kwargs["use_dummy_weight"])
    except StartupError as e:
        parser.error(str(e))
    shell = kwargs.pop("shell")
    # several: the kernel spreads the connections over the processes' sockets (Linux's SO_REUSEPORT)
    if kwargs["api_server_count"] > 1 and (shell or not sys.platform.startswith("linux")):
        why = "the shell serves no HTTP" if shell else "several API server processes need Linux (SO_REUSEPORT)"
        parser.error(f"--api-server-count {kwargs['api_server_count']}: {why}")
    tp = kwargs.pop("tp")
    served, aliases = _model_ids(given_model, model_path, kwargs.pop("served_model_name"))
    if shell:  # one conversation: one request slot, no batching
        kwargs.update(max_running_req=1, cuda_graph_max_bs=1, silent_output=True)
    if why := _multi_node_problem(tp, kwargs["nnodes"], kwargs["node_rank"], kwargs["dist_init_addr"]):
        parser.error(why)
    if tp > 1 and (why := tp_split_problem(model_path, tp)):
        parser.error(f"--tp {tp}: {why}")  # a readable message now, not an assertion in a rank's start-up
    dtype = _resolve_dtype(model_path, kwargs.pop("dtype"))
    kv_dtype = resolve_kv_cache_dtype(kwargs["kv_cache_dtype"], dtype)
    backend = kwargs["attention_backend"]
    if backend != "auto" and (why := kv_cache_dtype_problem(backend, dtype, kv_dtype)):
        parser.error(f"--kv-cache-dtype {kwargs['kv_cache_dtype']}: {why}")
    if kwargs["calculate_kv_scales"] and not is_fp8(kv_dtype):
        parser.error(f"--calculate-kv-scales needs an fp8 --kv-cache-dtype, not {kwargs['kv_cache_dtype']}")
    server_args = ServerArgs(model_path=model_path, tp_info=DistributedInfo(0, tp), dtype=dtype,
                             served_model_name=served, model_aliases=aliases, **kwargs)
    return server_args, shell
