"""Shared-suite entry point (see shared_tests/CONTRACT.md)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, Tuple

import torch

from .core import SamplingParams
from .llm import LLM

ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
OPTIONS = frozenset(
    {"page_size", "max_running_req", "num_pages", "attention_backend", "cache_type", "max_extend_tokens", "overlap"}
)
CAPABILITIES = frozenset({"batch", "sampling"})

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
        raise TypeError(f"stage2_scheduled does not understand option(s) {sorted(unknown)}")
    llm = _llm(model_dir, options)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_new_tokens)
    results = llm.generate(prompts, params, use_tqdm=False)
    if errors := [r["error"] for r in results if "error" in r]:
        raise RuntimeError(f"stage2_scheduled rejected {len(errors)} prompt(s): {errors[0]}")
    return [list(r["token_ids"]) for r in results]
