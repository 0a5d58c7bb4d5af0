"""Tiny random HF checkpoints built on the fly (seeded), so these unit tests need no prepared model."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, List

import pytest
import torch

from stage4_fast.core import Batch, get_global_ctx, set_global_ctx
from stage4_fast.engine import Engine, EngineConfig
from stage4_fast.harness import ServerProcess, server_process

# stage 4: without a GPU the Triton kernels run under Triton's interpreter, chosen before triton is first imported
# (nothing imported above loads triton: the kernels' modules are imported lazily)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

# original context 64 with factors 1/4: wavelengths below 16 keep their frequency, above 64 are divided by 8, and
# the band in between is blended; head_dim 64 with theta 5e5 has frequencies in all three regimes
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def _make_tiny(root: Path, arch: str) -> Path:
    import transformers

    if arch == "qwen2":  # qkv bias, untied head
        config = transformers.Qwen2Config(**TINY, tie_word_embeddings=False)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":  # per-head q/k norm, tied head
        config = transformers.Qwen3Config(**TINY, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "llama3":  # llama3 rope scaling, tied head
        config = transformers.LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # a wider init than HF's 0.02 so logits are far from uniform (no near-ties)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    path = root / arch
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = _make_tiny(root, arch)
        return made[arch]

    return get


def make_engine(path: Path, **kwargs) -> Engine:
    kwargs.setdefault("num_page_override", 64)
    kwargs.setdefault("max_running_req", 8)
    kwargs.setdefault("dtype", torch.float32)
    return Engine(EngineConfig(str(path), **kwargs))


@torch.inference_mode()
def forward_logits(engine: Engine, batch: Batch) -> torch.Tensor:
    """The model's logits for a prepared batch, without sampling or advancing the requests."""
    set_global_ctx(engine.ctx)
    with get_global_ctx().forward_batch(batch):
        return engine.model.forward()[: batch.size].to("cpu", copy=True)


@functools.lru_cache(maxsize=4)
def _hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logits(path: Path, ids: List[int]) -> torch.Tensor:
    """HF's logits for every position of one sequence."""
    return _hf_model(str(path))(torch.tensor([ids])).logits[0]


# ---- server fixtures ---------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def prepared_model(name: str) -> Path:
    """A model of the repo's models/ folder, prepared through its CLI if missing (a stage never imports `models`)."""
    dirname = {"smollm2": "SmolLM2-135M-Instruct"}.get(name, name)
    path = REPO / "models" / dirname
    if not (path / "config.json").exists():
        cmd = ["prepare", name] if name == "smollm2" else ["make", name]
        subprocess.run([sys.executable, "-m", "models", *cmd], cwd=REPO, check=True)
    return path


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return prepared_model("tiny-qwen3")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return prepared_model("smollm2")


# the tiny server's pool: small enough that the tests' own requests exercise queueing
TINY_SERVER_OPTIONS = dict(num_pages=1024, page_size=4, max_running_req=16, cache_type="radix")


@pytest.fixture(scope="session")
def tiny_server(tiny_dir: Path) -> Iterator[ServerProcess]:
    """One tiny-Qwen3 server for the load, disconnect and bad-input tests (they leave it idle between tests)."""
    with server_process(str(tiny_dir), **TINY_SERVER_OPTIONS) as server:
        yield server


# the tiny model's chat template with tools, Hermes-style: the tools in a system turn, each call of an assistant
# turn in <tool_call> tags
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions, each as <tool_call>{"name": ..., "arguments": ...}</tool_call>:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""



@pytest.fixture(scope="session")
def tools_model(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model with a chat template that renders tools."""
    model = tmp_path_factory.mktemp("tiny-qwen3-tools")
    for item in tiny_dir.iterdir():
        if item.name != "chat_template.jinja":
            os.symlink(item, model / item.name)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return model


@pytest.fixture(scope="session")
def tools_server(tools_model: Path) -> Iterator[ServerProcess]:
    """A server that reads tool calls (Hermes) and thinking blocks (Qwen3) out of the output, and logs every
    request (test_request_log.py reads a line)."""
    args = ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--enable-log-requests"]
    with server_process(str(tools_model), num_pages=4096, extra_args=args) as server:
        yield server


# ---- stage 4: same-interface fakes of the GPU attention libraries (tests/fakes) ----------------------------------


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The backends load their library through one function each; the tests swap the fakes in there (a fake
    ``flash_attn`` in sys.modules would mislead transformers' own import probes)."""
    from stage4_fast.attention import fi

    from .fakes import flashinfer

    flashinfer.calls.clear()
    monkeypatch.setattr(fi, "load_flashinfer", lambda: flashinfer)
    return flashinfer


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    from stage4_fast.attention import fa

    from .fakes import flash_attn_cute

    flash_attn_cute.calls.clear()
    monkeypatch.setattr(fa, "load_flash_attn_varlen_func", lambda: flash_attn_cute.flash_attn_varlen_func)
    return flash_attn_cute
