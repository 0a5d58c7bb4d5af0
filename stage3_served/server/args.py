"""Server configuration, built from the command line (`cli.py`) and the start-up checks (`preflight.py`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Tuple

import torch

from ..distributed import DistributedInfo
from ..scheduler.config import SchedulerConfig
from ..utils.hf import cached_load_hf_config
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
    # exposure limits (not upstream): see guard.py; repr=False keeps the key out of any log of the config
    api_key: str | None = field(default=None, repr=False)
    max_request_bytes: int = 1 << 20
    max_queued_requests: int = 1024  # requests waiting beyond the running ones before new ones get 503
    # longer than clients keep an idle connection (httpx 5 s, aiohttp 15 s), so the client drops it first: at
    # uvicorn's 5 s a request can race the server closing the connection and be lost
    timeout_keep_alive: int = 60

    @property
    def model_ids(self) -> Tuple[str, ...]:
        """Every id a request's `model` may name; the first is the one /v1/models lists."""
        return (self.served_model_name, *self.model_aliases)

    @property
    def effective_log_level(self) -> str:
        return "warning" if self.silent_output and self.log_level in ("debug", "info") else self.log_level

    @property
    def share_tokenizer(self) -> bool:
        return self.num_tokenizer == 0

    @property
    def zmq_frontend_addr(self) -> str:
        return "ipc:///tmp/minisgl_3" + self._unique_suffix

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
        return f"tcp://127.0.0.1:{self.server_port + 1}"

    @property
    def ipc_paths(self) -> List[str]:
        """Files behind the ipc:// addresses, removed at shutdown (a killed process leaves them behind)."""
        addrs = [self.zmq_backend_addr, self.zmq_detokenizer_addr, self.zmq_scheduler_broadcast_addr,
                 self.zmq_frontend_addr, *self.zmq_tokenizer_addrs]
        return [a.removeprefix("ipc://") for a in addrs if a.startswith("ipc://")]


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
    if kwargs["tp"] > 1:  # the scheduler I/O already broadcasts to other ranks; the engine cannot shard yet
        parser.error("tensor parallelism (--tp > 1) arrives with stage4_fast; stage3_served runs one rank")
    given_model = kwargs.pop("model_path")
    if kwargs.pop("load_format") == "dummy":
        kwargs["use_dummy_weight"] = True
    if kwargs.pop("trust_remote_code"):
        logger.warning("--trust-remote-code has no effect: only this engine's own model code runs")
    try:
        model_path = check_model(given_model, needs_weights=not kwargs["use_dummy_weight"])
    except StartupError as e:
        parser.error(str(e))
    shell = kwargs.pop("shell")
    tp = kwargs.pop("tp")
    served, aliases = _model_ids(given_model, model_path, kwargs.pop("served_model_name"))
    if shell:  # one conversation: one request slot, no batching
        kwargs.update(max_running_req=1, cuda_graph_max_bs=1, silent_output=True)
    dtype = _resolve_dtype(model_path, kwargs.pop("dtype"))
    server_args = ServerArgs(model_path=model_path, tp_info=DistributedInfo(0, tp), dtype=dtype,
                             served_model_name=served, model_aliases=aliases, **kwargs)
    return server_args, shell
