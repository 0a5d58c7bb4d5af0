"""One small adapter per engine, all with the same shape: load the model, `generate(prompts, output_lens)` greedily
with EOS ignored, report when each request finished. Each uses the stage's public API:

    hf      transformers `generate` on a left-padded batch (its usual offline use)
    stage0  `TinyEngine.generate`, one request after another
    stage1  `Engine` + `ManualBatcher`: one static batch (all prefilled together, decoded until the last one ends)
    stage2+ `LLM(model_path, ...).generate(prompts, SamplingParams(...))`: the scheduler's continuous batching
    stage3+ additionally `python -m <stage> --model DIR --port P`, the OpenAI-compatible server (see `launch_server`)

The stage2+ adapter also exposes two probes the ablations need, hooked on the scheduler's documented seams:
prefill tokens actually computed (`Engine.forward_batch`) and per-token arrival times (`send_result`).
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .meta import ROOT

STAGES = ["stage0_tiny", "stage1_correct", "stage2_scheduled", "stage3_served", "stage4_fast"]
ENGINES = ["hf", *STAGES]
LLM_STAGES = STAGES[2:]  # offline LLM.generate
SERVER_STAGES = STAGES[3:]  # python -m <stage> serves the OpenAI API


@dataclass
class GenResult:
    outputs: list[list[int]]
    finish_s: list[float]  # seconds from the start of the call until each request's last token was known


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFAdapter:
    """transformers' own `generate`: prompts left-padded into one batch, decoded to the longest output length."""

    def __init__(self, model: str, device: torch.device, dtype: torch.dtype, **options) -> None:
        if options:
            raise TypeError(f"hf takes no engine options, got {sorted(options)}")
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
        self.model.generation_config.eos_token_id = None  # ignore EOS: every engine does the same work

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> GenResult:
        t0 = time.perf_counter()
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(output_lens)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(self.device)
        elapsed = time.perf_counter() - t0
        rows = out[:, width:].tolist()
        return GenResult([r[:o] for r, o in zip(rows, output_lens)], [elapsed] * len(prompts))


class Stage0Adapter:
    def __init__(self, model: str, device: torch.device, dtype: torch.dtype, **options) -> None:
        if options:
            raise TypeError(f"stage0 takes no engine options, got {sorted(options)}")
        from stage0_tiny.tiny import TinyEngine

        self.engine = TinyEngine(model, dtype)
        if device.type == "cuda":  # stage0 knows no devices: move its tensors and make new ones land there too
            self.engine.w = {k: v.to(device) for k, v in self.engine.w.items()}
            self.engine.inv_freq = self.engine.inv_freq.to(device)
            torch.set_default_device(device)

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> GenResult:
        t0, outputs, finish = time.perf_counter(), [], []
        for p, o in zip(prompts, output_lens):
            outputs.append(self.engine.generate(p, o))  # eos_id=None: EOS ignored
            finish.append(time.perf_counter() - t0)
        return GenResult(outputs, finish)


class Stage1Adapter:
    """A static batch: every request prefilled in one forward, then decoded together; a finished request leaves
    the batch but nobody joins it (continuous batching is stage2's)."""

    def __init__(self, model: str, device: torch.device, dtype: torch.dtype, **options) -> None:
        from stage1_correct.core import SamplingParams
        from stage1_correct.engine import Engine, EngineConfig
        from stage1_correct.engine.manual import ManualBatcher

        self.sampling_params = SamplingParams
        self.engine = Engine(EngineConfig(model_path=model, dtype=dtype, **options))
        self.batcher = ManualBatcher(self.engine)

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> GenResult:
        t0 = time.perf_counter()
        outputs: list[list[int]] = [[] for _ in prompts]
        finish = [0.0] * len(prompts)
        group = self.engine.config.max_running_req
        for start in range(0, len(prompts), group):
            idx = range(start, min(start + group, len(prompts)))
            reqs = [self.batcher.add_req(prompts[i], self.sampling_params(temperature=0.0, max_tokens=output_lens[i],
                                                                          ignore_eos=True)) for i in idx]
            running, phase = list(zip(idx, reqs)), "prefill"
            while running:
                self.batcher.step([r for _, r in running], phase)
                phase, now = "decode", time.perf_counter() - t0
                for i, r in running:
                    if not r.can_decode:
                        finish[i] = now
                        outputs[i] = r.input_ids[len(prompts[i]):].tolist()
                        self.batcher.free_req(r)
                running = [(i, r) for i, r in running if r.can_decode]
        return GenResult(outputs, finish)


class LLMAdapter:
    """stage2+: the offline `LLM`. Options are `SchedulerConfig` fields (page_size, cache_type, max_extend_tokens,
    overlap_scheduling, cuda_graph_max_bs, ...)."""

    def __init__(self, stage: str, model: str, device: torch.device, dtype: torch.dtype, **options) -> None:
        self.sampling_params = importlib.import_module(f"{stage}.core").SamplingParams
        self.llm = importlib.import_module(f"{stage}.llm").LLM(model, dtype=dtype, **options)
        self.device = device
        self.token_times: dict[int, list[float]] = {}  # uid -> arrival time of each token (perf_counter)
        self.prefill_tokens = 0  # tokens computed by prefill forwards (what a prefix cache saves)
        forward_batch, send_result = self.llm.engine.forward_batch, self.llm.send_result

        def counting_forward_batch(batch, args, *hooks):  # extend_len is read before the forward advances them
            if batch.is_prefill:
                self.prefill_tokens += sum(r.extend_len for r in batch.reqs)
            return forward_batch(batch, args, *hooks)  # stage4's before_sampling passes through

        def timed_send_result(reply):
            now = time.perf_counter()
            for msg in reply:  # stage 4 sends a step's plain tokens as columns (TokenColumnsMsg)
                for uid in getattr(msg, "uids", None) or [msg.uid]:
                    self.token_times.setdefault(uid, []).append(now)
            send_result(reply)

        self.llm.engine.forward_batch = counting_forward_batch
        self.llm.send_result = timed_send_result

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> GenResult:
        self.token_times.clear()
        params = [self.sampling_params(temperature=0.0, max_tokens=o, ignore_eos=True) for o in output_lens]
        t0 = time.perf_counter()
        results = self.llm.generate(prompts, params, use_tqdm=False)
        finish = [self.token_times[uid][-1] - t0 for uid in range(len(prompts))]  # uids are prompt indices
        return GenResult([r["token_ids"] for r in results], finish)

    def hold_back(self, uid: int, release: Callable[[], bool]) -> dict[str, float]:
        """Keep request `uid` away from the scheduler until `release()` is true, as if it arrived then. Returns a
        dict that gets the release time under "t"."""
        receive_msg, held, released = self.llm.receive_msg, [], {}

        def receive(blocking: bool = False):
            if held and (blocking or release()):
                released["t"] = time.perf_counter()
                msgs, held[:] = list(held), []
                return msgs + receive_msg(blocking=False)
            msgs = receive_msg(blocking=blocking)
            held.extend(m for m in msgs if getattr(m, "uid", None) == uid)
            return [m for m in msgs if getattr(m, "uid", None) != uid]

        self.llm.receive_msg = receive
        return released


def shut_down(adapter) -> None:
    """Shut an in-process engine down (the `LLM` of stage2+; the others have nothing to stop). What it holds is
    freed once the caller drops its last reference and calls `free_unreferenced_memory`."""
    llm = getattr(adapter, "llm", None)
    if llm is not None and hasattr(llm, "shutdown"):
        llm.shutdown()


def free_unreferenced_memory(device: torch.device) -> None:
    """Collect what nothing references any more (an engine's object graph has cycles) and hand the device's cached
    blocks back to the driver, e.g. before a server that sizes its KV pool from the free memory starts."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_adapter(engine: str, model: str, device: torch.device, dtype: torch.dtype, **options):
    if engine == "hf":
        return HFAdapter(model, device, dtype, **options)
    if engine == "stage0_tiny":
        return Stage0Adapter(model, device, dtype, **options)
    if engine == "stage1_correct":
        return Stage1Adapter(model, device, dtype, **options)
    if engine in LLM_STAGES:
        return LLMAdapter(engine, model, device, dtype, **options)
    raise ValueError(f"unknown engine {engine!r}; one of {ENGINES}")


# ---- the server (stage3+) -----------------------------------------------------------------------------------------

SERVER_FLAGS = {  # option -> CLI flag of `python -m <stage>`
    "tp": "--tp", "page_size": "--page-size", "cache_type": "--cache-type",
    "max_extend_tokens": "--max-prefill-length", "cuda_graph_max_bs": "--cuda-graph-max-bs",
    "attention_backend": "--attention-backend", "kv_cache_dtype": "--kv-cache-dtype",
    "stream_interval": "--stream-interval", "api_server_count": "--api-server-count",  # (stage4 only)
}
SERVER_SWITCHES = {  # option -> flag given when the option is true
    "enable_mixed_chunk": "--enable-mixed-chunk", "calculate_kv_scales": "--calculate-kv-scales",
}
SERVER_OFF_SWITCHES = {  # ... given when it is false
    "prefill_cuda_graph": "--disable-prefill-cuda-graph", "overlap_scheduling": "--disable-overlap-schedule",
}


def _free_port() -> int:
    """A port p with p + 1 free too (the server puts its TP rendezvous on port + 1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


class ServerURL(str):
    """A launched server's base URL (a plain string wherever one is expected) that knows the server's process."""

    pid: int


@contextmanager
def launch_server(stage: str, model: str, log_path: Path, dtype: str, timeout_s: float = 600.0,
                  **options) -> Iterator[ServerURL]:
    """Start `python -m <stage> --model DIR --port P` in its own session, wait for /health, yield the base URL, and
    stop it (SIGTERM: the server takes its workers down) on exit."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", stage, "--model", model, "--port", str(port), "--dtype", dtype]
    env = dict(os.environ)
    for key, value in options.items():
        if key in SERVER_FLAGS:
            cmd += [SERVER_FLAGS[key], str(value)]
        elif key in SERVER_SWITCHES:
            cmd += [SERVER_SWITCHES[key]] if value else []
        elif key in SERVER_OFF_SWITCHES:
            cmd += [] if value or value is None else [SERVER_OFF_SWITCHES[key]]
        else:
            raise TypeError(f"no server flag for option {key!r}")
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready (log: {log_path})")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after {timeout_s:.0f} s (log: {log_path})")
            time.sleep(0.5)
        served = ServerURL(url)
        served.pid = proc.pid
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the process group we started it in: only its own processes
                proc.wait()
