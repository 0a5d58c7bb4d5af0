"""Shared-suite entry point (see shared_tests/CONTRACT.md)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import OrderedDict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Sequence, Tuple

import torch

from .core import SamplingParams
from .engine.graph import EMULATION_MAX_BS
from .llm import LLM

ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "Qwen3_5ForCausalLM"})
OPTIONS = frozenset({"page_size", "max_running_req", "num_pages", "attention_backend", "cache_type",
                     "max_extend_tokens", "overlap", "tp", "cuda_graph", "kv_cache_dtype"})
CAPABILITIES = frozenset({"batch", "sampling", "server"})

# option name -> SchedulerConfig field
_CONFIG_FIELD = {"page_size": "page_size", "max_running_req": "max_running_req", "num_pages": "num_page_override",
                 "attention_backend": "attention_backend", "cache_type": "cache_type",
                 "max_extend_tokens": "max_extend_tokens", "overlap": "overlap_scheduling",
                 "tp": "tp", "kv_cache_dtype": "kv_cache_dtype"}  # tp: an LLM argument, ranks > 0 in processes
# Loading a model dominates a small generate call: LLMs are reused within a process, a few at most (memory)
_LLMS: OrderedDict[Tuple[Any, ...], LLM] = OrderedDict()
_MAX_CACHED_LLMS = 2


def _llm(model_dir: str, options: dict) -> LLM:
    key = (str(model_dir), tuple(sorted(options.items())))
    if key in _LLMS:
        _LLMS.move_to_end(key)
        return _LLMS[key]
    if options.get("tp", 1) > 1 or any(llm.config.tp_info.size > 1 for llm in _LLMS.values()):
        while _LLMS:
            _LLMS.popitem()[1].shutdown()
    kwargs = {_CONFIG_FIELD[name]: value for name, value in options.items() if name != "cuda_graph"}
    if not options.get("cuda_graph", True):
        kwargs["cuda_graph_max_bs"] = 0
    elif not torch.cuda.is_available():
        # the engine runs eagerly on a CPU unless asked; the suite asks, so every case also checks the emulation
        kwargs["cuda_graph_max_bs"] = EMULATION_MAX_BS
    # several engines live in one process: a GPU's would each size their KV pool to 90% of the free memory
    kwargs.setdefault("num_page_override", 16384 // options.get("page_size", 1))
    llm = LLM(str(model_dir), dtype=torch.float32, **kwargs)
    _LLMS[key] = llm
    while len(_LLMS) > _MAX_CACHED_LLMS:
        _LLMS.popitem(last=False)[1].shutdown()
    return llm


def generate(model_dir: str, prompts: List[List[int]], max_new_tokens: int, **options: Any) -> List[List[int]]:
    """fp32, greedy, EOS ignored, through the scheduler (continuous batching) and LLM.generate."""
    if unknown := set(options) - OPTIONS:
        raise TypeError(f"stage4_fast does not understand option(s) {sorted(unknown)}")
    llm = _llm(model_dir, options)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_new_tokens)
    results = llm.generate(prompts, params, use_tqdm=False)
    if errors := [r["error"] for r in results if "error" in r]:
        raise RuntimeError(f"stage4_fast rejected {len(errors)} prompt(s): {errors[0]}")
    return [list(r["token_ids"]) for r in results]


_REPO = Path(__file__).resolve().parents[1]
# option -> command-line flag of `python -m stage4_fast`
_FLAGS = {"page_size": "--page-size", "cache_type": "--cache-type", "max_extend_tokens": "--max-prefill-length",
          "max_running_req": "--max-running-requests", "num_pages": "--num-pages",
          "attention_backend": "--attention-backend", "tp": "--tp", "kv_cache_dtype": "--kv-cache-dtype"}


def _die_with_parent() -> None:
    """Before exec: a killed test run takes its server with it (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port(span: int = 3) -> int:
    """A port p with p .. p + span - 1 all free: the server also binds port + 1 (TP rendezvous), multi-node port + 2."""
    for _ in range(100):
        with ExitStack() as held:
            socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(span)]
            socks[0].bind(("127.0.0.1", 0))
            port = socks[0].getsockname()[1]
            try:
                for extra, neighbour in enumerate(socks[1:], 1):
                    neighbour.bind(("127.0.0.1", port + extra))
            except (OSError, OverflowError):  # taken, or past port 65535
                continue
            return port
    raise RuntimeError(f"no run of {span} free ports on 127.0.0.1")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, as an operator would; returns the exit code (killed after timeout_s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise


@contextmanager
def server_process(model_dir: str, *, startup_timeout_s: float = 300.0, extra_args: Sequence[str] = (),
                   **options: Any) -> Iterator[ServerProcess]:
    """`python -m stage4_fast` on a free local port, ready on entry, SIGTERM on exit; a failed test prints its log."""
    if unknown := set(options) - OPTIONS:
        raise TypeError(f"stage4_fast's server does not understand option(s) {sorted(unknown)}")
    port = free_port()
    cmd = [sys.executable, "-m", "stage4_fast", "--model", str(model_dir), "--port", str(port),
           "--dtype", "float32", *extra_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]))
    for name, value in options.items():
        if name == "overlap":
            env["MINISGL_DISABLE_OVERLAP_SCHEDULING"] = "0" if value else "1"
        elif name == "cuda_graph":
            cmd += [] if value else ["--cuda-graph-max-bs", "0"]
        else:
            cmd += [_FLAGS[name], str(value)]
    log = Path(tempfile.mkstemp(prefix="stage4-server-", suffix=".log")[1])
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log)
    failed = False  # kept for the failure's report: the log, and its tail printed
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode} during start-up:\n{server.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready within {startup_timeout_s} s:\n{server.log()}")
            try:
                with urllib.request.urlopen(f"{server.base_url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        yield server
    except BaseException as e:
        # a test that failed, not one that skipped or a generator closed early
        failed = failed or not isinstance(e, GeneratorExit) and type(e).__name__ not in ("Skipped", "XFailed")
        raise
    finally:
        try:
            server.stop()
        except BaseException:
            failed = True
            raise
        finally:
            if failed:  # keep the server's log and print its tail (pytest shows it with the failure)
                tail = log.read_text(errors="replace").splitlines()[-80:]
                print(f"--- the server's log, kept at {log}; its last {len(tail)} lines ---", *tail, sep="\n",
                      file=sys.stderr)
            else:
                log.unlink(missing_ok=True)


@contextmanager
def serve(model_dir: str, **options: Any) -> Iterator[str]:
    """The shared suite's end-to-end case: a running server's base URL (``http://127.0.0.1:<port>``)."""
    with server_process(model_dir, **options) as server:
        yield server.base_url
