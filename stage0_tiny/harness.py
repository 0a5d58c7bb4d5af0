"""The uniform entry the shared suite drives (see shared_tests/CONTRACT.md): one request at a time."""

from __future__ import annotations

from functools import lru_cache

from .tiny import TinyEngine

ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
OPTIONS: frozenset[str] = frozenset()
CAPABILITIES: frozenset[str] = frozenset()


@lru_cache(maxsize=2)
def _engine(model_dir: str) -> TinyEngine:
    return TinyEngine(model_dir)


def generate(model_dir: str, prompts: list[list[int]], max_new_tokens: int, **options) -> list[list[int]]:
    if options:
        raise TypeError(f"stage0_tiny takes no engine options, got {sorted(options)}")
    engine = _engine(str(model_dir))
    return [engine.generate(p, max_new_tokens) for p in prompts]
