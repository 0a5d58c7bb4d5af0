"""stage0_tiny: the skeleton of an inference engine, in one file (``python -m stage0_tiny --help``).

Read config.json and the safetensors weights into a dict, run a hand-written decoder (RMSNorm, RoPE with the
half-split pairing, GQA via repeat_interleave, Qwen3's per-head q/k norm, Qwen2's qkv bias, Llama 3's RoPE
scaling), keep the KV cache as a per-layer list grown with ``torch.cat`` (every step copies the whole cache: the
first thing stage1 replaces with a preallocated paged pool), and decode greedily one request at a time. ``main``
times it with two thread counts, checks both give the same tokens, and compares them with transformers.
Everything later stages add — pages, batches, schedulers, servers, kernels — is an answer to a cost visible here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"


def load_config(model_dir: str | Path) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # transformers 5 nests rope_theta here
    cfg["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg["rope_scaling"] = rope if rope.get("rope_type", rope.get("type")) == "llama3" else None
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg


def load_weights(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                weights[name.removeprefix("model.")] = f.get_tensor(name).to(dtype)
    if "lm_head.weight" not in weights:  # tied embeddings
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return weights


def rope_inv_freq(cfg: dict) -> torch.Tensor:
    d = cfg["head_dim"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if s := cfg["rope_scaling"]:  # Llama 3: keep short wavelengths, divide long ones, blend in between
        old_ctx, factor = s["original_max_position_embeddings"], s["factor"]
        low_wl, high_wl = old_ctx / s["low_freq_factor"], old_ctx / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wl, inv_freq / factor, torch.where(wavelen < high_wl, inv_freq, blended))
    return inv_freq.float()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # half-split pairing: dim i rotates with dim i + d/2 (HF's rotate_half)
    x1, x2 = x[..., :half], x[..., half:]
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class TinyEngine:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32):
        self.cfg = load_config(model_dir)
        if self.cfg.get("num_experts"):
            raise NotImplementedError("stage0_tiny runs dense decoders only (MoE arrives in stage4_fast)")
        self.w = load_weights(model_dir, dtype)
        self.inv_freq = rope_inv_freq(self.cfg)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.prefill_s = 0.0  # seconds of the last generate's prefill

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"layers.{i}.self_attn."
        T, hq, hkv, d = x.shape[0], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = F.linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias")).view(T, hq, d)
        k = F.linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias")).view(T, hkv, d)
        v = F.linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).view(T, hkv, d)
        if p + "q_norm.weight" in w:  # Qwen3: RMSNorm over each head before RoPE
            eps = c["rms_norm_eps"]
            q, k = rms_norm(q, w[p + "q_norm.weight"], eps), rms_norm(k, w[p + "k_norm.weight"], eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if i < len(self.kv):  # naive KV cache: copy the whole history to append T tokens
            k, v = torch.cat([self.kv[i][0], k]), torch.cat([self.kv[i][1], v])
            self.kv[i] = (k, v)
        else:
            self.kv.append((k, v))
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)  # GQA
        S = k.shape[0]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # query t sees keys up to its own position
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return F.linear(o.transpose(0, 1).reshape(T, hq * d), w[p + "o_proj.weight"])

    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        c, w = self.cfg, self.w
        x = w["embed_tokens.weight"][ids]
        freqs = torch.outer(torch.arange(start, start + len(ids), dtype=torch.float32), self.inv_freq)
        cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            x = x + self.attention(i, rms_norm(x, w[p + "input_layernorm.weight"], c["rms_norm_eps"]), cos, sin)
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
            gate, up = F.linear(h, w[p + "mlp.gate_proj.weight"]), F.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        x = rms_norm(x[-1:], w["norm.weight"], c["rms_norm_eps"])  # only the last position is sampled
        return F.linear(x, w["lm_head.weight"])[0]

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None = None) -> list[int]:
        self.kv = []
        out: list[int] = []
        t0 = time.perf_counter()
        logits = self.forward(torch.tensor(prompt_ids), 0)  # prefill: the whole prompt in one forward
        self.prefill_s = time.perf_counter() - t0  # timed_run splits this run's time into prefill and decode
        for step in range(max_new_tokens):
            token = int(logits.argmax())  # greedy
            out.append(token)
            if token == eos_id or step == max_new_tokens - 1:
                break
            logits = self.forward(torch.tensor([token]), len(prompt_ids) + step)  # decode: one token
        return out


# -- python -m stage0_tiny: generate, time it, check it ---------------------------------------------------------
def physical_cores() -> int:
    """Distinct (socket, core) pairs in /proc/cpuinfo: hyperthreads share a core and its FMA units."""
    try:
        blocks = Path("/proc/cpuinfo").read_text().split("\n\n")  # one block per logical CPU
    except OSError:
        blocks = []
    cpus = [dict((k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in b.splitlines())) for b in blocks]
    cores = len({(cpu.get("physical id"), cpu["core id"]) for cpu in cpus if "core id" in cpu})
    return max(1, min(cores or os.cpu_count() or 1, len(os.sched_getaffinity(0))))


def timed_run(engine: TinyEngine, ids: list[int], n: int, threads: int) -> tuple[list[int], float, float]:
    """(tokens, prefill ms, decode tok/s) with `threads` torch threads, prefill and decode timed in one run."""
    torch.set_num_threads(threads)
    engine.generate(ids, 8)  # warm-up: first touches of the weights and allocator
    t0 = time.perf_counter()
    out = engine.generate(ids, n)
    decode_s = time.perf_counter() - t0 - engine.prefill_s
    return out, engine.prefill_s * 1e3, (len(out) - 1) / max(decode_s, 1e-9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stage0_tiny", description="generate, time it, check against HF")
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="HF model directory")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--no-hf-check", action="store_true")
    args = ap.parse_args(argv)
    if not Path(args.model, "config.json").exists():
        print(f"error: no model at {args.model}. Prepare the default one with: python -m models prepare smollm2",
              file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, engine = AutoTokenizer.from_pretrained(args.model), TinyEngine(args.model)
    c = engine.cfg
    print(f"model: {args.model} ({c['architectures'][0]}, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
          f"{c['num_attention_heads']} q / {c['num_key_value_heads']} kv heads, vocab {c['vocab_size']})")
    ids = tok(args.prompt).input_ids
    print(f"prompt: {args.prompt!r} ({len(ids)} tokens)")
    runs: list[list[int]] = []
    for threads, why in ((torch.get_num_threads(), "torch default"), (physical_cores(), "physical cores")):
        out, pre_ms, tps = timed_run(engine, ids, args.max_new_tokens, threads)
        if not runs:
            print(f"generated: {tok.decode(out)!r}")
        print(f"timing ({threads} threads, {why}): prefill {pre_ms:.1f} ms, decode {tps:.1f} tok/s")
        runs.append(out)
    if runs[1] != runs[0]:  # the thread count splits the sums differently; fp32 greedy must not notice
        print(f"thread counts disagree:\n  default: {runs[0]}\n  cores:   {runs[1]}")
        return 1
    if not args.no_hf_check:
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        print(f"match HF: {ref == out}")
        if ref != out:
            print(f"  HF:   {ref}\n  ours: {out}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
