"""What two production-API fields cost the host per decode step (stage4), no model involved: a JSON-schema grammar
(``GrammarBackend``) and the penalties' arguments (``Sampler.prepare``).

    python -m bench api-host [--rows 256] [--steps 30] [--out FILE.md]

A GPU step of the api-costs batch takes ~6 ms; host work per step beyond what overlap hides is added to it. Each
part measures the way stage4 does it now against how it did it before, in the same run, on the same states.

Grammar: `--rows` requests under `api_costs.GRAMMAR` with SmolLM2's tokenizer, at its own vocabulary (49,152) and
at the Qwen3 shape's logits width (151,936, what the GPU bench masks):

- before: the grammar compiled over the logits' width, so xgrammar takes every id past the tokenizer's for a
  special token; a new all-ones bitmask every step, each row filled by its matcher in a Python loop; each sampled
  token accepted and the end checked;
- now (``GrammarBackend``): the grammar over the tokenizer's ids (the sampler forbids the padded ones), one buffer
  kept from step to step, the rows filled by xgrammar's ``BatchGrammarMatcher`` (its default thread count: half
  the cores), the same token checks; the masks are checked equal to the first way's.

Each step every row samples one allowed token at random (seeded), so the matchers walk through varied states.

Penalties: `--rows` decode requests with presence, frequency and repetition penalties (prompts of 128–511 tokens,
64 generated), ``Sampler.prepare`` on the CPU (its device copies are the identity there):

- before: the [rows, length] token-pool positions and their masks built on the host (and copied every step);
- now: four [rows] vectors, the [rows, length] reads built on the device by ``apply_penalties``; the penalised
  logits are checked equal to the first way's.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

from . import meta
from .api_costs import DEFAULT_MODEL, GRAMMAR

VOCABS = (49152, 151936)


def _allowed_token(mask_row, vocab: int, rng: random.Random) -> int:
    """A random token id whose bit is set in one bitmask row (int32 words, bit j of word w = token 32 w + j)."""
    import torch

    words = mask_row.view(torch.int32)
    bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:vocab]
    allowed = bits.nonzero().view(-1)
    return int(allowed[rng.randrange(len(allowed))])


def measure_grammar(model: str, rows: int, steps: int, vocab: int) -> dict:
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from stage4_fast.sampling import GrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(model)
    # before: the grammar over the logits' width (padded ids and all), a fresh mask filled row by row
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(GRAMMAR, any_whitespace=False)
    before = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    # now: GrammarBackend (the tokenizer's ids only, one reused buffer, the batch matcher)
    backend = GrammarBackend(tokenizer, vocab)
    uids = list(range(rows))
    for uid in uids:
        backend.add(uid, GRAMMAR)
    words = backend.bitmask(uids).shape[1]
    rng = random.Random(0)
    times: dict[str, list[float]] = {"mask_before": [], "mask_now": [], "accept_before": [], "accept_now": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        fresh = xgr.allocate_token_bitmask(rows, vocab)
        for row, matcher in enumerate(before):
            matcher.fill_next_token_bitmask(fresh, row)
        t1 = time.perf_counter()
        mask = backend.bitmask(uids)
        t2 = time.perf_counter()
        # the same allowed tokens both ways; a padded id is never allowed
        assert torch.equal(fresh[:, :words], mask) and not fresh[:, words:].any(), "the two ways disagree"
        times["mask_before"].append(t1 - t0)
        times["mask_now"].append(t2 - t1)
        tokens = [_allowed_token(mask[row], backend.grammar_vocab, rng) for row in range(rows)]
        t3 = time.perf_counter()
        for matcher, token in zip(before, tokens):
            assert matcher.accept_token(token)
            matcher.is_terminated()
        t4 = time.perf_counter()
        for uid, token in zip(uids, tokens):
            backend.accept(uid, token)
        times["accept_before"].append(t4 - t3)
        times["accept_now"].append(time.perf_counter() - t4)
    result = {name: 1e3 * sum(xs) / len(xs) for name, xs in times.items()}
    return {"vocab": vocab, "special": len(info.special_token_ids), **result}


def _penalty_args_on_the_host(sampler, penalised):
    """How ``Sampler._penalty_args`` built its arguments before: the [rows, length] positions and masks on the host,
    then copied (the identity on the CPU). Returns what ``apply_penalties`` used to receive."""
    import torch

    starts = [0 if req.sampling_params.repetition_penalty != 1.0 else req.prompt_len for _, req in penalised]
    lengths = torch.tensor([req.device_len - start for (_, req), start in zip(penalised, starts)])
    offsets = torch.arange(max(1, int(lengths.max())))[None, :]
    valid = offsets < lengths[:, None]
    positions = torch.where(valid, torch.tensor(starts)[:, None] + offsets, 0)
    prompt_lens = torch.tensor([req.prompt_len for _, req in penalised])
    pool_rows = torch.tensor([req.table_idx for _, req in penalised])[:, None].expand_as(positions).contiguous()
    params = [req.sampling_params for _, req in penalised]
    return {"rows": torch.tensor([i for i, _ in penalised]),
            "presence": torch.tensor([p.presence_penalty for p in params]),
            "frequency": torch.tensor([p.frequency_penalty for p in params]),
            "repetition": torch.tensor([p.repetition_penalty for p in params]),
            "pool_rows": pool_rows, "positions": positions,
            "is_output": valid & (positions >= prompt_lens[:, None]), "is_seen": valid}


def _apply_host_built(logits, token_pool, a) -> None:
    """``apply_penalties`` as it read the host-built arguments (the same formulas)."""
    import torch

    vocab, m = logits.shape[-1], len(a["rows"])
    ids = torch.where(a["is_seen"], token_pool[a["pool_rows"], a["positions"]].long(), vocab)
    counts = torch.zeros(m, vocab + 1).scatter_add_(1, ids, a["is_output"].float())[:, :vocab]
    seen = torch.zeros(m, vocab + 1, dtype=torch.bool).scatter_(1, ids, True)[:, :vocab]
    x = logits[a["rows"]].float()
    rep = a["repetition"][:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - a["frequency"][:, None] * counts - a["presence"][:, None] * (counts > 0).float()
    logits[a["rows"]] = x.to(logits.dtype)


def measure_penalties(rows: int, steps: int, vocab: int) -> dict:
    import torch

    from stage4_fast.core import Batch, Req, SamplingParams
    from stage4_fast.engine import Sampler
    from stage4_fast.sampling import apply_penalties

    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    reqs = []
    for row in range(rows):
        prompt_len = 128 + (row * 37) % 384
        req = Req(torch.arange(prompt_len, dtype=torch.int32) % 1000, row, 0, 4096, row, params)
        req.device_len, req.cached_len = prompt_len + 64, prompt_len + 63
        reqs.append(req)
    gen = torch.Generator().manual_seed(0)
    token_pool = torch.randint(0, vocab, (rows, 1024), generator=gen, dtype=torch.int32)
    sampler, batch = Sampler(torch.device("cpu"), vocab), Batch(reqs, "decode")
    penalised = list(enumerate(reqs))
    before_s, now_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        host_built = _penalty_args_on_the_host(sampler, penalised)
        t1 = time.perf_counter()
        args = sampler.prepare(batch, token_pool)
        now_s.append(time.perf_counter() - t1)
        before_s.append(t1 - t0)
    logits = torch.randn(rows, vocab, generator=gen)
    expected, got = logits.clone(), logits.clone()
    _apply_host_built(expected, token_pool, host_built)
    apply_penalties(got, token_pool, args.penalties)
    assert torch.equal(expected, got), "the two ways must penalise the same logits"
    return {"rows": rows, "before_ms": 1e3 * sum(before_s) / steps, "now_ms": 1e3 * sum(now_s) / steps}


def report(results: list[dict], penalties: dict, args: argparse.Namespace, run_info: dict,
           loads: tuple[str, str]) -> str:
    lines = [
        "# What a JSON grammar and the penalties cost the host per decode step (stage4)",
        "",
        *meta.header_lines(run_info),
        f"- {args.rows} requests under `bench/api_costs.py`'s GRAMMAR, tokenizer of {meta.relative(args.model)}, "
        f"{args.steps} steps, each a random allowed token per row (seed 0); xgrammar's batch matcher on its default "
        f"{max(1, (os.cpu_count() or 2) // 2)} thread(s); {run_info['versions']}",
        f"- load average (1/5/15 min) before: {loads[0]}, after: {loads[1]}",
        "",
        "## JSON grammar",
        "",
        "| logits width | padded ids (special to xgrammar before) | mask before (ms/step) | mask now (ms/step) | "
        "token checks before (ms/step) | token checks now (ms/step) | host per step: before → now |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        before, now = r["mask_before"] + r["accept_before"], r["mask_now"] + r["accept_now"]
        lines.append(f"| {r['vocab']:,} | {r['special']:,} | {r['mask_before']:.2f} | {r['mask_now']:.2f} | "
                     f"{r['accept_before']:.2f} | {r['accept_now']:.2f} | {before:.2f} → {now:.2f} ms "
                     f"({before / now:.1f}×) |")
    lines += [
        "",
        "Before: the grammar over the logits' width, a fresh all-ones mask every step filled matcher by matcher, "
        "each token accepted and the end checked. Now (`GrammarBackend`): the grammar over the tokenizer's ids "
        "(the padded ids are forbidden by the sampler instead), one buffer reused every step, the rows filled by "
        "xgrammar's batch matcher. Means over the steps; both see the same tokens, and their masks are checked equal "
        "(a padded id is allowed by neither).",
        "",
        "## Penalties",
        "",
        "| rows | prepare, positions built on the host (ms/step) | prepare now (ms/step) | before → now |",
        "|---:|---:|---:|---:|",
        f"| {penalties['rows']} | {penalties['before_ms']:.2f} | {penalties['now_ms']:.2f} | "
        f"{penalties['before_ms'] / penalties['now_ms']:.1f}× |",
        "",
        "Presence, frequency and repetition penalties on every row, prompts of 128–511 tokens and 64 generated, "
        "vocabulary 151,936. Before: the penalty arguments alone (the [rows, length] positions and masks built on "
        "the host); now: all of `Sampler.prepare` (the penalties' four [rows] vectors and the rest of the batch's "
        "arguments). The logits both ways penalise are checked equal.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench api-host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="whose tokenizer (default: SmolLM2)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None,
                    help="markdown file to write (default: bench/local/cpu-api-host.md, gitignored)")
    args = ap.parse_args(argv)
    out = args.out or meta.LOCAL / "cpu-api-host.md"
    run_info = meta.run_meta("python -m bench api-host", argv)
    load_start = meta.load()
    results = [measure_grammar(args.model, args.rows, args.steps, vocab) for vocab in VOCABS]
    penalties = measure_penalties(args.rows, args.steps, VOCABS[-1])
    text = report(results, penalties, args, run_info, (load_start, meta.load()))
    meta.write_report(out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
