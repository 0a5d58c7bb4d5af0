"""Streaming safetensors loader: tensors are read one at a time, sharded for this TP rank and fused (q/k/v, gate/up)
as soon as a group is complete, so no second full copy of the weights exists. MoE experts are stacked into one
`[E, ...]` tensor per layer once every expert is in."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..distributed import get_tp_info
from ..utils import div_ceil
from ..utils.hf import download_hf_weight

# part name -> (fused name, position in the concatenation)
_MERGE = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
          ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}
_GROUP_SIZE = {".qkv_proj": 3, ".gate_up_proj": 2}


def _safetensors_files(model_dir: Path) -> List[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():  # sharded checkpoint: the index names its files
        weight_map: Dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) > 1:  # Mistral repos ship a duplicate consolidated file beside the HF shards
        files = [f for f in files if f.name != "consolidated.safetensors"]
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def _shard_tensor(key: str, value: torch.Tensor, r: int, n: int, num_kv_heads: int) -> torch.Tensor:
    """This rank's share of one checkpoint tensor (the identity when n == 1)."""
    if n == 1:
        return value
    if key.endswith(".experts.gate_up_proj"):  # already packed [E, 2I, H]: shard each half's rows
        gate, up = value.chunk(2, dim=1)
        return torch.cat([gate.chunk(n, dim=1)[r], up.chunk(n, dim=1)[r]], dim=1)
    if key.endswith(".experts.down_proj"):  # already packed [E, H, I]
        return value.chunk(n, dim=2)[r]
    if any(p in key for p in (".k_proj", ".v_proj")) and num_kv_heads < n:
        head = r * num_kv_heads // n  # fewer KV heads than ranks: replicate
        return value.chunk(num_kv_heads, dim=0)[head]
    if any(p in key for p in (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj")):
        return value.chunk(n, dim=0)[r]
    if any(p in key for p in (".o_proj", ".down_proj")):
        return value.chunk(n, dim=1)[r]
    if "lm_head" in key or "embed_tokens" in key:
        size = div_ceil(value.shape[0], n)
        shard = value[r * size : (r + 1) * size]
        if shard.shape[0] < size:  # n does not divide V: pad the last shard with zero rows (upstream fails here)
            pad = shard.new_zeros((size - shard.shape[0],) + tuple(shard.shape[1:]))
            shard = torch.cat([shard, pad])
        return shard
    return value


def _fused_key(key: str) -> Tuple[str, int] | None:
    for part, (fused, pos) in _MERGE.items():
        if part + "." in key:
            return key.replace(part + ".", fused + "."), pos
    return None


# fp8 checkpoints' per-layer KV scales under vLLM's and SGLang's names, yielded as `...self_attn.k_scale` / `v_scale`
_KV_SCALE_ALIAS = re.compile(
    r"^(?P<prefix>.*layers\.\d+\.self_attn)\.(?:attn\.(?P<a>[kv])_scale|(?P<b>[kv])_proj\.output_scale|(?P<c>[kv])_scale)$"
)
KV_SCALE_NAME = re.compile(r"layers\.(?P<layer>\d+)\.self_attn\.(?P<kv>[kv])_scale$")


def kv_scale_name(name: str) -> str | None:
    match = _KV_SCALE_ALIAS.match(name)
    return None if match is None else f"{match['prefix']}.{match['a'] or match['b'] or match['c']}_scale"


_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<idx>\d+)\.(?P<name>.+?)(?:\.weight)?$")


def _stack_experts(tensors: Iterator[Tuple[str, torch.Tensor]], num_experts: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """`mlp.experts.3.gate_up_proj.weight` (sharded and fused) -> one `mlp.experts.gate_up_proj` [E, ...]."""
    pending: Dict[str, Dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _EXPERT.match(name) if num_experts else None
        if match is None:
            yield name, tensor
            continue
        packed = f"{match['prefix']}.{match['name']}"
        parts = pending.setdefault(packed, {})
        parts[int(match["idx"])] = tensor
        if len(parts) == num_experts:
            del pending[packed]
            yield packed, torch.stack([parts[i] for i in range(num_experts)])
    if pending:
        raise RuntimeError(f"incomplete expert groups in checkpoint: {sorted(pending)[:8]}")


def load_weight(model_path: str, device: torch.device, num_kv_heads: int = 0,
                num_experts: int = 0) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields (name, tensor) on `device`, already sharded for this rank and fused, in checkpoint order."""
    yield from _stack_experts(_load_fused(model_path, device, num_kv_heads), num_experts)


def _load_fused(model_path: str, device: torch.device, num_kv_heads: int) -> Iterator[Tuple[str, torch.Tensor]]:
    tp = get_tp_info()
    model_dir = Path(download_hf_weight(model_path))
    files = _safetensors_files(model_dir)
    pending: Dict[str, Dict[int, torch.Tensor]] = {}
    with tqdm(desc="loading weights", unit="tensor", leave=False) as pbar:
        for file in files:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    pbar.update(1)
                    if key.startswith(("vision_tower.", "multi_modal_projector.")):
                        continue
                    name = key.replace("language_model.", "", 1) if key.startswith("language_model.") else key
                    if (scale_name := kv_scale_name(name)) is not None:  # a scalar: every rank keeps it whole
                        yield scale_name, f.get_tensor(key)
                        continue
                    tensor = _shard_tensor(name, f.get_tensor(key), tp.rank, tp.size, num_kv_heads)
                    fused = _fused_key(name)
                    if fused is None:
                        yield name, tensor
                        continue
                    fused_name, pos = fused
                    parts = pending.setdefault(fused_name, {})
                    parts[pos] = tensor
                    group = next(n for suffix, n in _GROUP_SIZE.items() if suffix + "." in fused_name)
                    if len(parts) == group:
                        del pending[fused_name]
                        yield fused_name, torch.cat([parts[i] for i in range(group)], dim=0)
    if pending:
        raise RuntimeError(f"incomplete fused groups in checkpoint: {sorted(pending)[:8]}")
