"""Stage 4's test helpers: HF greedy references and LLM runs on the prepared tiny models."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, List, Sequence

import torch

from .helpers import greedy, make_llm

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 200, 300], [5] * 21, [42]]
NEW_TOKENS = 8


@functools.lru_cache(maxsize=2)
def _hf(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def _hf_one(path: str, prompt: tuple, n: int) -> tuple:
    with torch.inference_mode():
        out = _hf(path).generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=0, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def hf_generate(path: Path, prompts: Sequence[Sequence[int]] = PROMPTS, n: int = NEW_TOKENS) -> List[List[int]]:
    return [list(_hf_one(str(path), tuple(p), n)) for p in prompts]


def llm_generate(path: Path, prompts: Sequence[Sequence[int]] = PROMPTS, n: int = NEW_TOKENS,
                 **config: Any) -> List[List[int]]:
    """One fresh LLM (fp32, the scheduler with overlap), shut down afterwards."""
    config.setdefault("max_running_req", 8)
    llm = make_llm(path, **config)
    try:
        return [r["token_ids"] for r in llm.generate(list(prompts), greedy(n), use_tqdm=False)]
    finally:
        llm.shutdown()
