"""The `shapes` ablation group (`python -m bench --gpu --ablations shapes`): stage4 on real models' layer shapes,
each measurement beside its memory floor.

Per shape, one worker process (`python -m bench worker --task shape`): the device's copy rate (a D2D copy of a
1 GiB buffer, bytes read + written / time, best of 10, measured before the engine loads), single-stream decode of
1,024 tokens and the offline workload, the floor of each: the bytes its decode steps must read over that rate, and
where each one's time goes (`offline_split`, `decode_split`).

Bytes a decode step must read (from the checkpoint's tensor headers, so any architecture is counted as stored):
every weight except the embedding table (one row per token) and the experts, plus for an MoE layer the experts the
step routes to: top-k for one token; for a batch of B tokens, the expected number of distinct experts under
uniform routing, E * (1 - (1 - k/E)^B) (an estimate: trained routers are not uniform), plus the KV cache of every
token each request attends to. The offline floor sums these over the workload's decode steps as if every request
ran from the start and the batch drained as requests finish: no schedule reads fewer weights (a smaller batch
reads them more often) and every schedule reads the same KV, so it bounds any engine's rate from above. Prefill
is left out (its compute, not its bytes, bounds it), which flatters the offline floor: most where a token's
FLOPs are many, the dense 8B.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

from .meta import ROOT

# The Qwen3-30B-A3B shape at 16 of its 48 layers (~21 GB in bf16, the full depth ~61 GB): with the 8B shape
# (16 GB) it leaves room on a 64 GiB disk for the environment, and making and loading it fits the group's minutes
MOE_LAYERS = 16
MOE_SHAPE = "qwen3-30b-a3b-shape"
SHAPES = {"qwen3-8b-shape": None, MOE_SHAPE: MOE_LAYERS}  # name -> layers (None: full depth)
DECODE_LEN = 1024
COPY_BYTES = 1 << 30


def shape_models() -> dict[str, Path]:
    """Directory name -> path of each shape model (made by `python -m models make NAME [--layers N]`)."""
    from models.random_models import model_name

    return {model_name(n, layers): ROOT / "models" / model_name(n, layers) for n, layers in SHAPES.items()}


def make_command(dir_name: str) -> list[str]:
    name, layers = next((n, la) for n, la in SHAPES.items() if dir_name.startswith(n))
    return ["-m", "models", "make", name, "--device", "cuda"] + (["--layers", str(layers)] if layers else [])


def copy_rate(repeats: int = 10) -> float:
    """Device memory bytes/s: a torch copy between two 1 GiB buffers, (read + written) / time, best of `repeats`."""
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / best


def model_bytes(model: str | Path) -> dict:
    """What a decode step reads, from the checkpoint's headers: dense bytes (every tensor but the embedding table
    and the experts), the embedding row, per-layer bytes of one expert, experts and top-k, KV bytes per token."""
    from safetensors import safe_open

    model = Path(model)
    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    experts, top_k = num_experts(cfg), cfg.get("num_experts_per_tok", 0)
    dense, embed, expert_layers = 0, 0, {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                t = st.get_slice(key)
                shape, size = t.get_shape(), _dtype_bytes(t.get_dtype())
                n = size
                for d in shape:
                    n *= d
                if match := re.search(r"layers\.(\d+)\.mlp\.experts\.", key):
                    expert_layers[match[1]] = expert_layers.get(match[1], 0) + n
                elif "embed_tokens" in key and not cfg.get("tie_word_embeddings"):
                    embed = shape[-1] * size  # one row per token (tied, the LM head reads all of it: dense)
                else:
                    dense += n
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"dense": dense, "embed_row": embed, "expert": [b / experts for b in expert_layers.values()],
            "experts": experts, "top_k": top_k,
            "kv_per_token": 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 2}  # K and V, bf16


def num_experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # (transformers 5 writes the latter)


def _dtype_bytes(name: str) -> int:
    return {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4}.get(name, 2)


def distinct_experts(experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts that `batch` tokens route to, each choosing top_k of `experts` uniformly."""
    return experts * (1 - (1 - top_k / experts) ** batch) if experts else 0.0


def step_bytes(mb: dict, batch: int, kv_tokens: int) -> float:
    """Bytes one decode step of `batch` requests reads, their contexts holding `kv_tokens` tokens together."""
    experts = distinct_experts(mb["experts"], mb["top_k"], batch) * sum(mb["expert"])
    return mb["dense"] + batch * mb["embed_row"] + experts + kv_tokens * mb["kv_per_token"]


def decode_floor(mb: dict, prompt_len: int, new_tokens: int) -> float:
    """Seconds x rate (bytes) of single-stream decode: steps 1 .. n-1 after the prefill, step t attends to
    prompt + t tokens."""
    return sum(step_bytes(mb, 1, prompt_len + t) for t in range(1, new_tokens))


def offline_floor(mb: dict, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Bytes of the offline workload's decode steps, every request running from the start (the prefill gives each
    its first token), the batch draining as requests finish."""
    total = 0.0
    for t in range(1, max(output_lens)):
        active = [p for p, o in zip(prompt_lens, output_lens) if o > t]
        total += step_bytes(mb, len(active), sum(active) + t * len(active))
    return total


def task_shape(engine: Callable, model: str, workload, sizes, vocab: int) -> dict:
    """The copy rate (before `engine()` loads the model), single-stream decode of 1,024 tokens, the offline workload,
    the floor of each, and where their time goes: the offline run's device time by phase (its steps timed by
    `python -m bench breakdown`'s instrument) and a kernel profile of single-stream decode steps (GPU)."""
    from dataclasses import replace

    import torch

    from .gpu_breakdown import Instrument, summarize
    from .worker import task_decode, task_offline
    from .workloads import random_prompt

    rate = copy_rate()
    print(f"[shapes] {model}: copy rate {rate / 1e9:,.0f} GB/s; loading", flush=True)
    mb = model_bytes(model)
    adapter, cuda = engine(), torch.cuda.is_available()
    decode = task_decode(adapter, replace(sizes, decode_len=DECODE_LEN, repeats=2), vocab)
    print(f"[shapes] decode {decode['tok_s']:,.0f} tok/s; the offline workload", flush=True)
    inst = Instrument(adapter.llm, cuda=cuda)  # from here on every step is timed (~10 us of host time a step)
    inst.reset()
    offline = task_offline(adapter, workload)
    inst.finish()
    steps = summarize(inst, offline["seconds"], workload.output_tokens)
    if cuda:
        offline["device_s"] = {"prefill": steps["prefill"]["device_total_s"],
                               "decode": steps["decode"]["device_total_s"], "idle": steps["device_idle_s"]}
        inst.reset()
        inst.profile_at, inst.profile_steps = PROFILE_AT, PROFILE_STEPS
        adapter.generate([random_prompt(vocab, 32, seed=4000)], [PROFILE_AT + 2 * PROFILE_STEPS + 2])
        inst.finish()
        decode["profile"] = inst.profiles["graph"]
    off_bytes = offline_floor(mb, list(map(len, workload.prompts)), workload.output_lens)
    dec_bytes = decode_floor(mb, 32, DECODE_LEN)  # task_decode's 32-token prompts
    return {"copy_bytes_per_s": rate, "model_bytes": mb, "offline": offline, "decode": decode,
            "offline_floor_tok_s": workload.output_tokens * rate / off_bytes, "offline_floor_s": off_bytes / rate,
            "decode_floor_tok_s": (DECODE_LEN - 1) * rate / dec_bytes,
            "decode_step_bytes_1": step_bytes(mb, 1, 32)}


PROFILE_AT, PROFILE_STEPS = 16, 8  # the profiled decode steps of one stream (CUDA graphs; then as many eager)


def offline_split(r: dict) -> str:
    """"prefill 3.2 s + decode 13.4 s (floor 11.1 s) + idle 0.2 s": the offline run's device time by phase."""
    d = r["offline"].get("device_s")
    if not d:
        return ""
    return (f"; device: prefill {d['prefill']:.1f} s + decode {d['decode']:.1f} s (floor {r['offline_floor_s']:.1f} "
            f"s) + idle {d['idle']:.1f} s")


def decode_split(r: dict) -> str:
    """A single-stream step's kernels by kind (charged end to end, CUDA graph profile) beside the floor of each:
    dense weights, routed experts, the KV cache."""
    p = r["decode"].get("profile")
    if not p:
        return ""
    mb, rate = r["model_bytes"], r["copy_bytes_per_s"]
    floors = {"gemm": mb["dense"], "moe": mb["top_k"] * sum(mb["expert"]),
              "attention": p["mean_kv_tokens"] * mb["kv_per_token"]}
    names = {"gemm": "dense weights", "moe": "experts", "attention": "attention", "other": "other"}
    parts = [f"{names[k]} {us / 1e3:.2f} ms" + (f" (floor {floors[k] / rate * 1e3:.2f})"
                                                 if floors.get(k, 0) / rate >= 5e-6 else "")  # shown as 0.00
             for k, us in sorted(p["serial_us"].items(), key=lambda kv: list(names).index(kv[0])) if us >= 1]
    return f"; step {1e3 / r['decode']['tok_s']:.2f} ms: " + ", ".join(parts + [f"idle {p['idle_us'] / 1e3:.2f}"])


def shape_rows(results: dict, out: list[dict], fail: Callable[..., bool]) -> None:
    """Two rows per shape (offline, single-stream decode): tok/s, floor tok/s, % of floor."""
    for key, job in results["jobs"].items():
        if not key.startswith("abl:shapes:") or fail(f"shape {key.split(':', 2)[2]}", key):
            continue
        r = job.get("result", {}).get("tasks", {}).get("shape")
        if not r:
            continue
        gb_s = r["copy_bytes_per_s"] / 1e9
        for part, floor, what, split in (
                ("offline", r["offline_floor_tok_s"], r["offline"]["workload"], offline_split),
                ("decode", r["decode_floor_tok_s"], f"one stream, {DECODE_LEN} tokens", decode_split)):
            tok_s = r[part]["tok_s"]
            out.append({"name": f"shape {key.split(':', 2)[2]}: {part}", "stage": job["stage"], "workload": what,
                        "off": f"{tok_s:,.0f} out tok/s",
                        "on": f"floor {floor:,.0f} tok/s (copy rate {gb_s:,.0f} GB/s; one-token step "
                              f"{r['decode_step_bytes_1'] / 1e9:.2f} GB)",
                        "effect": f"{tok_s / floor:.0%} of floor" + split(r),
                        "plot": [("output tok/s", tok_s, floor, "measured", "floor")]})
