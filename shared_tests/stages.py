"""The five stage packages and how the suite reaches each one's harness."""

from __future__ import annotations

import importlib
import json
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import pytest

STAGES = ["stage0_tiny", "stage1_correct", "stage2_scheduled", "stage3_served", "stage4_fast"]
REPO = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=None)
def harness(stage: str) -> ModuleType | None:
    if not (REPO / stage / "__init__.py").exists():
        return None
    return importlib.import_module(f"{stage}.harness")


def require(stage: str, model_dir: Path | None = None, options: dict | None = None,
            capabilities: tuple[str, ...] = ()) -> ModuleType:
    """The stage's harness, or a skip that says exactly what is missing."""
    h = harness(stage)
    if h is None:
        pytest.skip(f"{stage}: stage not built yet")
    if model_dir is not None:
        arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
        if arch not in h.ARCHITECTURES:
            pytest.skip(f"{stage} does not support {arch}")
    missing = sorted(set(options or {}) - set(h.OPTIONS))
    if missing:
        pytest.skip(f"{stage} has no option {', '.join(missing)}")
    lacking = sorted(set(capabilities) - set(h.CAPABILITIES))
    if lacking:
        pytest.skip(f"{stage} lacks capability {', '.join(lacking)}")
    return h
