from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from stage2_scheduled.layers import get_rope, set_rope_device
from stage2_scheduled.models import ModelConfig

from .conftest import LLAMA3_ROPE

HEAD_DIM = 64


def _hf_config(rope_parameters: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        rope_parameters=rope_parameters,
    )


def _our_rope(hf_config: LlamaConfig):
    set_rope_device(torch.device("cpu"))  # an engine built earlier in this process may have pointed it at a GPU
    rc = ModelConfig.from_hf(hf_config).rotary_config
    scaling = tuple(sorted(rc.scaling.items())) if rc.scaling else None
    return get_rope(rc.head_dim, rc.rotary_dim, rc.max_position, rc.base, scaling)


def test_llama3_inverse_frequencies_match_hf():
    config = _hf_config(LLAMA3_ROPE)
    hf_inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    ours = _our_rope(config)
    assert attention_scaling == 1.0
    wavelen = 2 * torch.pi / ours.inv_freq
    assert (wavelen < 16).any() and ((wavelen > 16) & (wavelen < 64)).any() and (wavelen > 64).any()
    torch.testing.assert_close(ours.inv_freq, hf_inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, dict(rope_type="default", rope_theta=10000.0)],
                         ids=["llama3", "default"])
def test_rotary_embedding_matches_hf(rope):
    config = _hf_config(rope)
    torch.manual_seed(0)
    T, Hq, Hkv = 37, 4, 2
    positions = torch.randint(0, 1024, (T,))
    q, k = torch.randn(T, Hq, HEAD_DIM), torch.randn(T, Hkv, HEAD_DIM)

    hf_rotary = LlamaRotaryEmbedding(config)
    cos, sin = hf_rotary(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    our_q, our_k = _our_rope(config).forward(positions, q, k)
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_get_rope_is_shared_per_parameters():
    config = _hf_config(LLAMA3_ROPE)
    assert _our_rope(config) is _our_rope(config)
    assert _our_rope(config) is not _our_rope(_hf_config(dict(rope_type="default", rope_theta=10000.0)))


def test_old_style_rope_scaling_config_parses_like_the_new_one():
    new = ModelConfig.from_hf(_hf_config(LLAMA3_ROPE).to_dict()).rotary_config
    old_style = _hf_config(LLAMA3_ROPE).to_dict()
    del old_style["rope_parameters"]
    old_style["rope_theta"] = LLAMA3_ROPE["rope_theta"]
    old_style["rope_scaling"] = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_theta", "rope_type")}
    old_style["rope_scaling"]["type"] = "llama3"
    assert ModelConfig.from_hf(old_style).rotary_config == new
