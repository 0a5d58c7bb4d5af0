from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stage4_fast.core import SamplingParams
from stage4_fast.engine import ManualBatcher
from stage4_fast.models import load_weight

from .conftest import make_engine


def _split_checkpoint(src: Path, dst: Path, num_shards: int = 3) -> None:
    """Rewrite a single-file checkpoint as HF does for big models: several files plus model.safetensors.index.json.
    Keys are dealt round-robin, so q/k/v (and gate/up) of one layer land in different files."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {key: names[i % num_shards] for i, key in enumerate(sorted(tensors))}
    for name in names:
        save_file(
            {k: t.contiguous() for k, t in tensors.items() if weight_map[k] == name},
            str(dst / name),
            metadata={"format": "pt"},
        )
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": weight_map,
    }
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_loads_the_same_weights(tiny_model, tmp_path):
    src = tiny_model("qwen2")
    _split_checkpoint(src, tmp_path / "sharded")
    single = dict(load_weight(str(src), torch.device("cpu")))
    sharded = dict(load_weight(str(tmp_path / "sharded"), torch.device("cpu")))
    assert single.keys() == sharded.keys()
    for key in single:
        assert torch.equal(single[key], sharded[key]), key


def test_loader_fuses_qkv_and_gate_up_in_order(tiny_model):
    src = tiny_model("qwen2")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    loaded = dict(load_weight(str(src), torch.device("cpu")))
    prefix = "model.layers.1."
    attn = prefix + "self_attn."
    for kind in ("weight", "bias"):  # Qwen2 has q/k/v biases: fused the same way
        expected = torch.cat([raw[f"{attn}{p}_proj.{kind}"] for p in "qkv"])
        assert torch.equal(loaded[f"{attn}qkv_proj.{kind}"], expected)
    expected = torch.cat([raw[f"{prefix}mlp.gate_proj.weight"], raw[f"{prefix}mlp.up_proj.weight"]])
    assert torch.equal(loaded[f"{prefix}mlp.gate_up_proj.weight"], expected)
    assert not any(p in k for k in loaded for p in (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"))


def test_engine_on_sharded_checkpoint_generates_the_same(tiny_model, tmp_path):
    src = tiny_model("qwen3")
    _split_checkpoint(src, tmp_path / "sharded", num_shards=2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_tokens=6)
    a = ManualBatcher(make_engine(src)).generate(prompts, params)
    b = ManualBatcher(make_engine(tmp_path / "sharded")).generate(prompts, params)
    assert a == b


def test_bf16_load_converts_every_weight(tiny_model):
    engine = make_engine(tiny_model("qwen2"), dtype=torch.bfloat16)
    dtypes = {t.dtype for t in engine.model.state_dict().values()}
    assert dtypes == {torch.bfloat16}
    assert engine.kv_cache.dtype == torch.bfloat16
    out = ManualBatcher(engine).generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert len(out[0]) == 3 and all(0 <= t < 512 for t in out[0])
