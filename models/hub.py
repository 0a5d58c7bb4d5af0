"""Resolve a model argument: local directory, known model name, or hub id (huggingface_hub)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse


class HubUnavailableError(RuntimeError):
    pass


def hub_reachable(timeout: float = 3.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def resolve(name_or_path: str) -> Path:
    from . import MODELS_DIR, ensure
    from .random_models import RANDOM_MODELS

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if (MODELS_DIR / name_or_path).is_dir():
        return MODELS_DIR / name_or_path
    if name_or_path in RANDOM_MODELS or name_or_path in ("smollm2", "SmolLM2-135M-Instruct"):
        return ensure(name_or_path)
    if os.environ.get("HF_HUB_OFFLINE") != "1" and not hub_reachable():
        raise HubUnavailableError(
            f"{name_or_path!r} is not a local directory and the Hugging Face hub cannot be reached; "
            "pass a local model directory or run `python -m models prepare smollm2`"
        )
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
