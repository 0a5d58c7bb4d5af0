"""Stage1 milestone: one request, then four prompts in one batch over the paged KV cache, each checked against HF
transformers token for token (fp32, greedy, EOS ignored); the batched first request must equal its solo run."""

from __future__ import annotations

import argparse
import sys
from typing import List, Sequence

import torch

from stage4_fast.core import SamplingParams
from stage4_fast.engine import Engine, EngineConfig, ManualBatcher
from stage4_fast.utils.hf import ModelNotFoundError, load_tokenizer, resolve_model_path

PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):", "Once upon a time,"]


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> List[int]:
    """The reference: HF's own forward with its KV cache, argmax each step, no EOS stop."""
    ids, cache, out = torch.tensor([list(prompt)]), None, []
    for _ in range(max_new_tokens):
        result = model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache = result.past_key_values
        out.append(int(result.logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stage4_fast", description=__doc__)
    parser.add_argument(
        "--model", default=None, help="model directory or hub id (default: models/SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        model_path = resolve_model_path(args.model)
    except ModelNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    engine = Engine(EngineConfig(model_path, dtype=torch.float32, page_size=args.page_size, max_running_req=8))
    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_new_tokens)
    batcher = ManualBatcher(engine)
    all_ok = True

    def report(label: str, ok: bool) -> None:
        nonlocal all_ok
        all_ok &= ok
        print(f"{label}matches HF: {ok}")

    print(f"model: {model_path}  page_size: {args.page_size}  new tokens: {args.max_new_tokens}")
    print("\n== one request ==")
    solo = batcher.generate(prompts[:1], params)[0]
    print(f"{PROMPTS[0]!r} -> {tokenizer.decode(solo)!r}")
    references = [hf_greedy(hf_model, p, args.max_new_tokens) for p in prompts]
    report("", solo == references[0])

    print("\n== four prompts in one batch ==")
    reqs = [batcher.add_req(p, params) for p in prompts]
    batcher.step(reqs, "prefill")
    for req in reqs:  # the page-table row now maps each prompt position to its KV slot
        slots = engine.page_table[req.table_idx, : req.cached_len].tolist()
        pages = sorted({s // args.page_size for s in slots})
        print(f"req {req.uid}: slot row {req.table_idx}, {req.cached_len} prompt tokens -> pages {pages}")
    while running := [r for r in reqs if r.can_decode]:
        batcher.step(running, "decode")
    outputs = [req.input_ids[len(p) :].tolist() for req, p in zip(reqs, prompts)]
    # every position that has KV now (cached_len of them per request) maps to its own slot
    slots = [set(engine.page_table[r.table_idx, : r.cached_len].tolist()) for r in reqs]
    disjoint = len(set().union(*slots)) == sum(len(s) for s in slots)
    pages = {s // args.page_size for s in set().union(*slots)}
    print(f"pages written: {len(pages)} of {engine.num_pages}; no slot shared between requests: {disjoint}")
    all_ok &= disjoint
    for req in reqs:
        batcher.free_req(req)
    for text, out, reference in zip(PROMPTS, outputs, references):
        print(f"{text!r} -> {tokenizer.decode(out)!r}")
        report("  ", out == reference)
    same = outputs[0] == solo
    all_ok &= same
    print(f"\nbatched first request equals solo run: {same}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
