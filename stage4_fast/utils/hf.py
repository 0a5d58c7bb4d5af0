"""Hugging Face glue: model-path resolution, config and tokenizer loading."""

from __future__ import annotations

import copy
import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

# the embedded default model lives in the repository's models/ folder (prepared, not committed)
DEFAULT_MODEL_PATH = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct"


class ModelNotFoundError(RuntimeError):
    pass


def _hub_reachable(timeout: float = 3.0) -> bool:
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _looks_like_path(model: str) -> bool:
    """Hub ids are "name" or "org/name"; anything else (absolute, ./, ~, deeper) was meant as a directory."""
    return Path(model).is_absolute() or model.startswith((".", "~")) or model.count("/") > 1 or Path(model).exists()


def resolve_model_path(model: str | os.PathLike | None = None) -> str:
    """None -> the embedded default model; a directory -> itself; anything else -> a hub id, downloaded
    (safetensors + json + tokenizer files) after a quick reachability check so an offline machine fails fast."""
    if model is None:
        if not DEFAULT_MODEL_PATH.is_dir():
            raise ModelNotFoundError(f"default model not found at {DEFAULT_MODEL_PATH}; "
                                     "prepare it with `python -m models prepare smollm2`")
        return str(DEFAULT_MODEL_PATH)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return str(path)
    if _looks_like_path(str(model)):  # not a hub id: asking the hub would only say "invalid repo id"
        raise ModelNotFoundError(f"no model directory at {path}")
    if os.environ.get("HF_HUB_OFFLINE") != "1" and not _hub_reachable():
        raise ModelNotFoundError(f"{str(model)!r} is not a local directory and huggingface.co cannot be reached; "
                                 "pass a local model directory (or `python -m models prepare smollm2`)")
    from huggingface_hub import snapshot_download

    return snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])


def download_hf_weight(model_path: str) -> str:
    """Directory holding the *.safetensors files (a local directory is used as is)."""
    return resolve_model_path(model_path)


@functools.cache
def _load_hf_config(model_path: str) -> PretrainedConfig:
    return AutoConfig.from_pretrained(model_path)


def cached_load_hf_config(model_path: str) -> PretrainedConfig:
    # cached by path; a fresh copy each call so callers may mutate it
    return copy.deepcopy(_load_hf_config(model_path))


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_path)


def tp_split_problem(model_path: str, tp: int) -> str | None:
    """Why the attention heads cannot be sharded over `tp` ranks, or None; asked before any rank starts (a message)."""
    config = cached_load_hf_config(model_path)
    config = getattr(config, "text_config", None) or config
    q = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or q
    if q % tp:
        return f"the model's {q} attention heads do not split evenly over {tp} ranks"
    if kv % tp and tp % kv:
        return f"the model's {kv} key/value heads neither split evenly over {tp} ranks nor replicate onto them"
    return None
