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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Sequence, Tuple

import torch

from .core import SamplingParams
from .llm import LLM

ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
OPTIONS = frozenset(
    {"page_size", "max_running_req", "num_pages", "attention_backend", "cache_type", "max_extend_tokens", "overlap"}
)
CAPABILITIES = frozenset({"batch", "sampling", "server"})

# option name -> SchedulerConfig field
_CONFIG_FIELD = {
    "page_size": "page_size",
    "max_running_req": "max_running_req",
    "num_pages": "num_page_override",
    "attention_backend": "attention_backend",
    "cache_type": "cache_type",
    "max_extend_tokens": "max_extend_tokens",
    "overlap": "overlap_scheduling",
}
# Loading a model dominates a small generate call: LLMs are reused within a process, a few at most (memory)
_LLMS: OrderedDict[Tuple[Any, ...], LLM] = OrderedDict()
_MAX_CACHED_LLMS = 2


def _llm(model_dir: str, options: dict) -> LLM:
    key = (str(model_dir), tuple(sorted(options.items())))
    if key in _LLMS:
        _LLMS.move_to_end(key)
        return _LLMS[key]
    kwargs = {_CONFIG_FIELD[name]: value for name, value in options.items()}
    # several engines live in one process: a GPU's would each size their KV pool to 90% of the free memory
    kwargs.setdefault("num_page_override", 16384 // options.get("page_size", 1))
    llm = LLM(str(model_dir), dtype=torch.float32, **kwargs)
    _LLMS[key] = llm
    while len(_LLMS) > _MAX_CACHED_LLMS:
        _LLMS.popitem(last=False)
    return llm


def generate(model_dir: str, prompts: List[List[int]], max_new_tokens: int, **options: Any) -> List[List[int]]:
    """fp32, greedy, EOS ignored, through the scheduler (continuous batching) and LLM.generate."""
    if unknown := set(options) - OPTIONS:
        raise TypeError(f"stage3_served does not understand option(s) {sorted(unknown)}")
    llm = _llm(model_dir, options)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_new_tokens)
    results = llm.generate(prompts, params, use_tqdm=False)
    if errors := [r["error"] for r in results if "error" in r]:
        raise RuntimeError(f"stage3_served rejected {len(errors)} prompt(s): {errors[0]}")
    return [list(r["token_ids"]) for r in results]


_REPO = Path(__file__).resolve().parents[1]
# option -> command-line flag of `python -m stage3_served`
_FLAGS = {
    "page_size": "--page-size",
    "cache_type": "--cache-type",
    "max_extend_tokens": "--max-prefill-length",
    "max_running_req": "--max-running-requests",
    "num_pages": "--num-pages",
    "attention_backend": "--attention-backend",
}


def _die_with_parent() -> None:
    """Before exec: a killed test run takes its server with it (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """`python -m stage3_served` on a free local port, ready on entry, SIGTERM on exit; a failed test prints its log."""
    if unknown := set(options) - OPTIONS:
        raise TypeError(f"stage3_served's server does not understand option(s) {sorted(unknown)}")
    port = free_port()
    cmd = [sys.executable, "-m", "stage3_served", "--model", str(model_dir), "--port", str(port),
           "--dtype", "float32", *extra_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]))
    for name, value in options.items():
        if name == "overlap":
            env["MINISGL_DISABLE_OVERLAP_SCHEDULING"] = "0" if value else "1"
        else:
            cmd += [_FLAGS[name], str(value)]
    log = Path(tempfile.mkstemp(prefix="stage3-server-", suffix=".log")[1])
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
