"""Streaming safetensors loader: tensors are read one at a time, sharded for this TP rank and fused (q/k/v ->
qkv_proj, gate/up -> gate_up_proj) as soon as a group is complete, so no second full copy of the weights exists."""

from __future__ import annotations

import json
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
    if any(p in key for p in (".k_proj", ".v_proj")) and num_kv_heads < n:
        head = r * num_kv_heads // n  # fewer KV heads than ranks: replicate
        return value.chunk(num_kv_heads, dim=0)[head]
    if any(p in key for p in (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj")):
        return value.chunk(n, dim=0)[r]
    if any(p in key for p in (".o_proj", ".down_proj")):
        return value.chunk(n, dim=1)[r]
    if "lm_head" in key or "embed_tokens" in key:
        size = div_ceil(value.shape[0], n)
        return value[r * size : min((r + 1) * size, value.shape[0])]
    return value


def _fused_key(key: str) -> Tuple[str, int] | None:
    for part, (fused, pos) in _MERGE.items():
        if part + "." in key:
            return key.replace(part + ".", fused + "."), pos
    return None


def load_weight(model_path: str, device: torch.device, num_kv_heads: int = 0) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields (name, tensor) on `device`, already sharded for this rank and fused, in checkpoint order."""
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
