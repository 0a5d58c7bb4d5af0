"""Teacher forcing: the engine is fed HF's greedy tokens, so its logits can be compared with HF's at every step even
where 16-bit rounding would make free-running generations part ways."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, List, Tuple

import torch


def hf_reference(path: Path, num_prompts: int, steps: int, seed: int = 0,
                 device: str = "cuda") -> Tuple[list, list, torch.Tensor]:
    """Prompts, HF bf16 greedy continuations, and HF's logits for every step (one full forward per sequence):
    [num_prompts, steps, vocab] fp32 (on the CPU, so that TP ranks on other GPUs can compare with it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(20, 300))] for _ in range(num_prompts)]
    forced, logits = [], []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p], device=device), max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            gen = out[0, len(p):].tolist()
            full = model(out[:, :-1]).logits[0, len(p) - 1:].float()
            forced.append(gen)
            logits.append(full.cpu())
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return prompts, forced, torch.stack(logits)


def stage_logits(path: Path, prompts: List[List[int]], forced: List[List[int]], prefill_graph: bool = False,
                 prefill_padding: int = 0, **config: Any) -> torch.Tensor:
    """The engine's logits for the same steps, fed the forced tokens: [num_prompts, steps, vocab] fp32 on the CPU
    (``config``: EngineConfig fields, overriding the defaults below). ``prefill_graph``: the prompts' prefill step
    replays a prefill graph captured at its token count (where the engine can capture one), or, with
    ``prefill_padding``, at that many tokens more: the step is padded with dummy prompts up to it.
    Runs on the engine's device (a CPU too: a dry run of the GPU scripts); TP ranks each call it with their
    ``tp_info`` and the same inputs, so their collectives line up."""
    from stage4_fast.core import SamplingParams, set_global_ctx
    from stage4_fast.engine import Engine, EngineConfig, ManualBatcher
    from stage4_fast.utils.device import stream_context, to_device

    steps = len(forced[0])
    engine = Engine(EngineConfig(str(path), **{"max_running_req": max(8, len(prompts)), "num_page_override": 4096,
                                               **config}))
    batcher = ManualBatcher(engine)
    reqs = [batcher.add_req(p, SamplingParams(max_tokens=steps)) for p in prompts]
    if prefill_graph:
        engine.capture_prefill_graph(sum(map(len, prompts)) + prefill_padding)
    out = torch.empty(len(prompts), steps, engine.config.model_config.vocab_size)
    try:
        phase = "prefill"
        for step in range(steps):
            set_global_ctx(engine.ctx)
            batch = batcher.make_batch(reqs, phase)
            if phase == "prefill" and engine.prefill_graph is not None:
                # the step replays the graph it was meant to, padded by exactly prefill_padding tokens
                padded = sum(r.extend_len for r in batch.padded_reqs)
                assert padded == sum(map(len, prompts)) + prefill_padding, padded
            with torch.inference_mode(), stream_context(engine.stream), engine.ctx.forward_batch(batch):
                logits, _ = engine.forward_logits(batch)
                out[:, step] = logits[: batch.size].float().cpu()
            rows = torch.tensor([r.table_idx for r in reqs])
            cols = torch.tensor([r.device_len for r in reqs])
            tokens = torch.tensor([f[step] for f in forced], dtype=torch.int32)
            for req, token in zip(reqs, tokens):
                req.complete_one()
                req.append_host(token)
            device = engine.device
            batcher.token_pool[to_device(rows, device), to_device(cols, device)] = to_device(tokens, device)
            phase = "decode"
    finally:
        engine.shutdown()
    return out
