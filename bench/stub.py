"""An engine whose forward returns a token per request in no time: what is left is the host's work around it (the
scheduler's batching, prefix cache and messages), measured by `python -m bench serve-path` (the serving path) and
`python -m bench breakdown --stub-forward` (an offline `generate`)."""

from __future__ import annotations

import importlib
import time


def install_stub_forward(stage: str, step_s: float = 0.0) -> None:
    """Replace the stage's ``Engine.forward_batch`` (in this process) with an instant token source: every sampled id
    a real token of the model's vocabulary (from [100, vocab - 100)), deterministic per request and position;
    ``step_s`` sleeps per step, like a GPU step."""
    import torch

    engine_mod = importlib.import_module(f"{stage}.engine.engine")
    record_event = importlib.import_module(f"{stage}.utils.device").record_event

    def forward_batch(engine, batch, args, before_sampling=None):
        if step_s:
            time.sleep(step_s)
        for req in batch.reqs:
            req.complete_one()
        if before_sampling is not None:  # stage4: the scheduler's bookkeeping of a launched batch
            before_sampling()
        vocab = engine.config.model_config.vocab_size
        tokens = [100 + (req.uid * 7919 + req.device_len * 104729) % (vocab - 200) for req in batch.reqs]
        t = torch.tensor(tokens, dtype=torch.int32)
        return engine_mod.ForwardOutput(t, t, record_event(engine.device))

    engine_mod.Engine.forward_batch = forward_batch
