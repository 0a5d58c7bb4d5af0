"""The command line: upstream's flags plus vLLM's and SGLang's spellings; a mistake ends in one line.

Prefix abbreviations are off (``--tokenizer`` would silently mean ``--tokenizer-count``); upstream's short forms
(``--tp``, ``--shell``, ``--cache``) are aliases."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Any, Callable, List, NoReturn

import torch

from ..attention import SUPPORTED_ATTENTION_BACKENDS, validate_attn_backend
from ..kvcache import KV_CACHE_DTYPE_CHOICES
from ..moe import SUPPORTED_MOE_BACKENDS
from .reasoning import REASONING_PARSERS
from .tool_calls import TOOL_CALL_PARSERS

DEFAULT_PROG = "python -m stage4_fast"

# --dtype: ours, vLLM's and SGLang's names (auto = the model config's dtype)
DTYPES = {"auto": None, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "float": torch.float32,
          "fp32": torch.float32}
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]

# flags of upstream, vLLM or SGLang that this server does not offer, and why (looked up for unknown flags only)
UNSUPPORTED_FLAGS = {
    "--disable-pynccl": "this engine has no PyNCCL: all-reduce goes through torch.distributed, as the flag asks",
    "--model-source": "models come from a local directory or the Hugging Face hub",
    **dict.fromkeys(["--tokenizer", "--tokenizer-path"], "the tokenizer is read from the model directory"),
    "--chat-template": "the model's own chat template is used",
    "--quantization": "quantized weights are not supported; weights load in --dtype",
    "--revision": "pass a local model directory (or a hub id at its default revision)",
    "--enable-lora": "LoRA adapters are not supported",
    "--pipeline-parallel-size": "pipeline parallelism is not implemented; use --tp",
    "--speculative-algorithm": "speculative decoding is not implemented",
    "--enable-prefix-caching": "the radix prefix cache is on by default (--cache-type naive turns it off)",
}


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" unless the help names its default or there is none (None, False, SUPPRESS)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default:" in text or default is None or default is False or default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class ServerArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's usage block: `python -m stage4_fast: error: ...`."""
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: List[str] | None = None, namespace: argparse.Namespace | None = None
                   ) -> argparse.Namespace:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(self._explain_unknown(unknown))
        return parsed

    def _explain_unknown(self, unknown: List[str]) -> str:
        flag = next((a for a in unknown if a.startswith("-")), unknown[0])
        name = flag.split("=", 1)[0]
        if name in UNSUPPORTED_FLAGS:
            return f"{name} is not supported: {UNSUPPORTED_FLAGS[name]}"
        if not name.startswith("-"):
            return f"unexpected argument {name!r} (the model is given with --model)"
        known = [s for action in self._actions for s in action.option_strings]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        return f"unknown flag {name}" + (f" (did you mean {close[0]}?)" if close else " (--help lists the flags)")


def _checked(kind: type, ok: Callable[[Any], bool], problem: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``text`` as ``kind``, refused with ``problem`` (``{}``: the value) unless ``ok``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(problem.format(value))
        return value

    return parse


_positive_int = _checked(int, lambda v: v >= 1, "must be >= 1, got {}")
_non_negative_int = _checked(int, lambda v: v >= 0, "must be >= 0, got {}")
_port = _checked(int, lambda v: 1 <= v <= 65535, "a TCP port is 1..65535, got {}")
_fraction = _checked(float, lambda v: 0.0 < v <= 1.0, "must be in (0, 1], got {}")


def _attention_backend(text: str) -> str:
    try:
        return validate_attn_backend(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser(run_shell: bool = False, prog: str = DEFAULT_PROG) -> ServerArgumentParser:
    p = ServerArgumentParser(prog=prog, description="mini-sglang stage 4: OpenAI-compatible server, fast path",
                             formatter_class=_HelpFormatter, allow_abbrev=False)
    _add_model_args(p)
    _add_parallel_args(p)
    _add_scheduling_args(p)
    _add_http_args(p, run_shell)
    return p


def _add_model_args(p: ServerArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-path", "--model", dest="model_path", default=None, metavar="PATH",
                   help="local model directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id of /v1/models (default: the directory's name; --model's path works too)")
    g.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="weights and activations; auto = the dtype in the model's config.json (float32 if none)")
    g.add_argument("--dummy-weight", dest="use_dummy_weight", action="store_true",
                   help="random weights of the model's shapes instead of loading them (benchmarks)")
    g.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default="auto",
                   help="vLLM/SGLang spelling: dummy = --dummy-weight")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM/SGLang command lines; no effect: only this engine's model code runs")


def _add_parallel_args(p: ServerArgumentParser) -> None:
    g = p.add_argument_group("parallelism and memory")
    g.add_argument("--tensor-parallel-size", "--tp-size", "--tp", "-tp", dest="tp", type=_positive_int, default=1,
                   metavar="N", help="one scheduler process per rank (with --nnodes: of all machines)")
    g.add_argument("--nnodes", type=_positive_int, default=1, metavar="M",
                   help="machines that run the --tp ranks together, tp / M on each")
    g.add_argument("--node-rank", type=_non_negative_int, default=0, metavar="R",
                   help="this machine's index; node 0 serves the API, the others run their ranks only")
    g.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="node 0's address for the ranks' rendezvous (node 0 also listens on PORT+1 and PORT+2)")
    g.add_argument("--memory-ratio", "--mem-fraction-static", "--gpu-memory-utilization", dest="memory_ratio",
                   type=_fraction, default=0.9, metavar="RATIO",
                   help="share of the GPU memory free after the weights that the KV cache takes (vLLM's: of all)")
    g.add_argument("--num-pages", dest="num_page_override", type=_positive_int, default=None, metavar="N",
                   help="KV cache pages (overrides --memory-ratio)")
    g.add_argument("--page-size", "--block-size", dest="page_size", type=_positive_int, default=1, metavar="TOKENS",
                   help="tokens per KV cache page")
    g.add_argument("--max-seq-len-override", "--max-model-len", "--context-length", dest="max_seq_len_override",
                   type=_positive_int, default=None, metavar="TOKENS",
                   help="context length in tokens (default: the model's max_position_embeddings)")


def _add_scheduling_args(p: ServerArgumentParser) -> None:
    attn = ", ".join(SUPPORTED_ATTENTION_BACKENDS.supported_names())
    moe = ", ".join(SUPPORTED_MOE_BACKENDS.supported_names())
    g = p.add_argument_group("scheduling and kernels")
    g.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_req", type=_positive_int,
                   default=256, metavar="N", help="requests decoded together at most")
    g.add_argument("--max-prefill-length", "--max-extend-length", "--chunked-prefill-size",
                   "--max-num-batched-tokens", dest="max_extend_tokens", type=_positive_int, default=8192,
                   metavar="TOKENS", help="prefill tokens per step; a longer prompt is prefilled in chunks this size")
    g.add_argument("--enable-mixed-chunk", action="store_true", help="decode steps ride in each prefill batch")
    g.add_argument("--stream-interval", type=_positive_int, default=1, metavar="N",
                   help="a streamed request's tokens leave the scheduler every N steps (first and last at once)")
    g.add_argument("--cache-type", "--cache", dest="cache_type", default="radix", choices=["naive", "radix"],
                   help="radix = reuse the KV of shared prompt prefixes")
    g.add_argument("--disable-radix-cache", dest="cache_type", action="store_const", const="naive",
                   default=argparse.SUPPRESS, help="SGLang spelling of --cache-type naive")
    g.add_argument("--disable-overlap-schedule", dest="overlap_scheduling", action="store_const", const=False,
                   default=argparse.SUPPRESS, help="each batch's results before the next forward (SGLang's flag)")
    g.add_argument("--attention-backend", "--attn", dest="attention_backend", type=_attention_backend,
                   default="auto", metavar="NAME", help=f"auto, one of {attn}, or PREFILL,DECODE (e.g. fa,fi)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="auto = the model's dtype; fp8 halves the bytes per token (scales from the checkpoint)")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 KV without checkpoint scales: per-layer scales from a calibration prefill (vLLM's flag)")
    g.add_argument("--moe-backend", choices=["auto", *SUPPORTED_MOE_BACKENDS.supported_names()], default="auto",
                   help=f"MoE models: one of {moe}; auto = fused on a GPU, torch on CPU")
    g.add_argument("--cuda-graph-max-bs", "--graph", dest="cuda_graph_max_bs", type=_non_negative_int,
                   default=None, metavar="BS", help="largest decode batch run as a CUDA graph; 0 = none (default: "
                                                    "256 on a GPU, 160 with <= 60 GiB free, 0 on CPU)")
    g.add_argument("--disable-cuda-graph", "--enforce-eager", dest="cuda_graph_max_bs", action="store_const",
                   const=0, default=argparse.SUPPRESS, help="SGLang / vLLM spelling of --cuda-graph-max-bs 0")
    g.add_argument("--disable-prefill-cuda-graph", dest="prefill_cuda_graph", action="store_const", const=False,
                   default=None, help="launch prefill steps eagerly, not as padded CUDA graph replays")
    g.add_argument("--num-tokenizer", "--tokenizer-count", dest="num_tokenizer", type=_non_negative_int, default=0,
                   metavar="N", help="tokenizer processes; 0 = one process tokenizes and detokenizes")


def _add_http_args(p: ServerArgumentParser, run_shell: bool) -> None:
    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", dest="server_host", default="127.0.0.1", metavar="ADDR", help="address to listen on")
    g.add_argument("--port", dest="server_port", type=_port, default=1919, metavar="PORT",
                   help="HTTP port; with --tp > 1 the ranks also meet on port + 1")
    g.add_argument("--api-key", default=os.environ.get("MINISGL_API_KEY") or None, metavar="KEY",
                   help="require 'Authorization: Bearer <key>' but on /health (default: $MINISGL_API_KEY)")
    g.add_argument("--api-server-count", type=_positive_int, default=1, metavar="N",
                   help="HTTP server processes sharing the port (Linux)")
    g.add_argument("--max-request-bytes", type=_positive_int, default=1 << 20, metavar="BYTES",
                   help="larger request bodies get 413")
    g.add_argument("--max-queued-requests", type=_positive_int, default=1024, metavar="N",
                   help="requests waiting beyond --max-running-requests; more get 503 + Retry-After")
    g.add_argument("--timeout-keep-alive", type=_positive_int, default=60, metavar="S",
                   help="close a keep-alive connection idle for S seconds (longer than the clients' own)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="of every process, uvicorn's included")
    g.add_argument("--log-level-http", choices=LOG_LEVELS, default=None, help="uvicorn's, if not --log-level")
    g.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false",
                   help="no log line per HTTP request (vLLM's flag)")
    g.add_argument("--enable-log-requests", "--log-requests", dest="log_requests", action="store_true",
                   help="log each request when it arrives and when it ends")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false", default=argparse.SUPPRESS,
                   help="vLLM's older spelling of the default: no request log")
    g.add_argument("--max-log-len", type=_non_negative_int, default=None, metavar="N",
                   help="prompt characters or token ids a request's log line shows (default: all)")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="read <tool_call> blocks out of the output (tool_choice auto)")
    g.add_argument("--enable-auto-tool-choice", action="store_true", help="vLLM's; needs --tool-call-parser")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="read a <think> block out into reasoning_content")
    g.add_argument("--shell-mode", "--shell", dest="shell", action="store_true", default=run_shell,
                   help="interactive chat in this terminal instead of an HTTP server")


def prog_name() -> str:
    """`python -m stage4_fast` or `python -m stage4_fast.serve`: the command that was actually run."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None) or ""
    if name.split(".")[0] != __name__.split(".")[0]:  # called from elsewhere (a test, a script)
        return DEFAULT_PROG
    return f"python -m {name.removesuffix('.__main__')}"
