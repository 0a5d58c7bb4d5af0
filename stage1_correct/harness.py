"""Shared-suite entry point (see shared_tests/CONTRACT.md)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, Tuple

import torch

from .core import SamplingParams
from .engine import Engine, EngineConfig, ManualBatcher

ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
OPTIONS = frozenset({"page_size", "max_running_req", "num_pages", "attention_backend"})
CAPABILITIES = frozenset({"batch", "sampling"})

# option name -> EngineConfig field
_CONFIG_FIELD = {
    "page_size": "page_size",
    "max_running_req": "max_running_req",
    "num_pages": "num_page_override",
    "attention_backend": "attention_backend",
}
# Loading a model dominates a small generate call, so engines are reused within a process. Each engine re-installs
# its own global context before every forward, so keeping several alive is safe; keep only a few (memory).
_ENGINES: OrderedDict[Tuple[Any, ...], Engine] = OrderedDict()
_MAX_CACHED_ENGINES = 2


def _engine(model_dir: str, options: dict) -> Engine:
    key = (str(model_dir), tuple(sorted(options.items())))
    if key in _ENGINES:
        _ENGINES.move_to_end(key)
        return _ENGINES[key]
    kwargs = {_CONFIG_FIELD[name]: value for name, value in options.items()}
    # several engines live in one process: a GPU's would each size their KV pool to 90% of the free memory
    kwargs.setdefault("num_page_override", 16384 // options.get("page_size", 1))
    engine = Engine(EngineConfig(str(model_dir), dtype=torch.float32, **kwargs))
    _ENGINES[key] = engine
    while len(_ENGINES) > _MAX_CACHED_ENGINES:
        _ENGINES.popitem(last=False)
    return engine


def generate(model_dir: str, prompts: List[List[int]], max_new_tokens: int, **options: Any) -> List[List[int]]:
    """fp32, greedy, EOS ignored: all prompts prefilled in one batch, then decoded together."""
    if unknown := set(options) - OPTIONS:
        raise TypeError(f"stage1_correct does not understand option(s) {sorted(unknown)}")
    engine = _engine(model_dir, options)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_new_tokens)
    return ManualBatcher(engine).generate(prompts, params)
