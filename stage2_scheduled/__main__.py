"""``python -m stage2_scheduled [--model DIR]``: offline ``LLM.generate`` on the embedded default model.

Four chat questions go in at once (continuous batching), then the same system prompt with new questions, whose
shared prefix the radix cache serves; greedy decoding, fp32.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .core import SamplingParams
from .llm import LLM
from .utils.hf import ModelNotFoundError, resolve_model_path

SYSTEM = "You are a concise assistant. Answer in one or two sentences."
QUESTIONS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "What does a CPU do?",
    "Why is the sky blue?",
]
MORE_QUESTIONS = ["What is the largest planet?", "Name a famous painter."]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m stage2_scheduled", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory or hub id (default: the embedded SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cache", choices=["radix", "naive"], default="radix")
    args = ap.parse_args()
    try:
        model = resolve_model_path(args.model)
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    llm = LLM(model, dtype=torch.float32, cache_type=args.cache)
    if llm.tokenizer is None:
        print(f"error: {model} has no tokenizer", file=sys.stderr)
        return 1

    def chat(question: str) -> list[int]:  # token-id prompts: the chat template is applied here
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        encoded = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        return list(encoded["input_ids"])

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for title, questions in (("batch", QUESTIONS), ("same system prompt, new questions", MORE_QUESTIONS)):
        prompts = [chat(q) for q in questions]
        prefill = [0]
        forward_batch = llm.engine.forward_batch

        def count(batch, sample_args, _fb=forward_batch, _n=prefill):
            if batch.is_prefill:
                _n[0] += sum(r.extend_len for r in batch.reqs)
            return _fb(batch, sample_args)

        llm.engine.forward_batch = count
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        llm.engine.forward_batch = forward_batch
        print(f"\n== {title}")
        for question, out in zip(questions, outputs):
            print(f"Q: {question}\nA: {out['text'].strip()}\n")
        n_out = sum(len(o["token_ids"]) for o in outputs)
        n_prompt = sum(map(len, prompts))
        print(
            f"{len(prompts)} requests, {n_out} tokens in {elapsed:.2f} s ({n_out / elapsed:.1f} tok/s); "
            f"prefill computed {prefill[0]} of {n_prompt} prompt tokens"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
