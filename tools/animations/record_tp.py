"""Stage 4's offline LLM with tp=2 on CPU (gloo; tp=3 for a model whose heads do not split in two, as SmolLM2's
9): every all-reduce of each rank, with the layer that called it and the tensor's shape, and where each forward step
began.

Rank 0 is this process; the others are spawned processes. Both record through the same wrapper: here it is installed
directly, and a ``sitecustomize`` in a temporary directory on the spawned rank's PYTHONPATH installs it there as soon
as the stage's module is imported (``install_on_import``). Each rank appends JSON lines to its own file.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from .hooks import lookup, patch, split
from .record_engine import PROMPTS, Recording, _params, run_llm

LOG_DIR_ENV = "ANIMATE_TP_LOG_DIR"
TARGETS = ("all_reduce4", "forward_batch4")

SITECUSTOMIZE = """\
import sys
sys.path.insert(0, {tools!r})
from animations.record_tp import install_on_import
install_on_import()
"""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _write(record: Dict[str, Any]) -> None:
    path = Path(os.environ[LOG_DIR_ENV]) / f"rank{_rank()}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _all_reduce(original: Any) -> Any:
    def all_reduce(self: Any, x: Any) -> Any:
        caller = sys._getframe(1).f_locals.get("self")
        start = time.perf_counter()
        out = original(self, x)
        _write({"event": "all_reduce", "caller": type(caller).__name__, "shape": list(x.shape), "t0": start,
                "t1": time.perf_counter()})
        return out

    return all_reduce


def _forward_batch(original: Any) -> Any:
    def forward_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        _write({"event": "step", "kind": "prefill" if batch.is_prefill else "decode", "size": int(batch.size),
                "t0": time.perf_counter()})
        return original(self, batch, *args, **kwargs)

    return forward_batch


WRAPPERS = {"all_reduce4": _all_reduce, "forward_batch4": _forward_batch}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps each target once its module has been imported (in the spawned rank, before any forward)."""

    def __init__(self) -> None:
        self.modules = {split(name)[0]: name for name in TARGETS}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        name = self.modules.get(fullname)
        if name is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            sys.modules[fullname] = module
            patch(name, WRAPPERS[name])

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install_on_import() -> None:
    if os.environ.get(LOG_DIR_ENV):
        import importlib.util  # noqa: F401  (find_spec above)

        sys.meta_path.insert(0, _PatchOnImport())


def pick_tp(model: str) -> int:
    """2, or the smallest rank count the model's attention heads split over."""
    for tp in (2, 3, 4):
        if lookup("tp_split_problem4")(model, tp) is None:
            return tp
    raise ValueError(f"{model}: its attention heads split over none of 2, 3, 4 ranks")


def record_tp(model: str, n_requests: int = 2, max_tokens: int = 3, tp: int | None = None) -> Recording:
    tp = tp or pick_tp(model)
    tools = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        hook_dir = Path(tmp) / "hook"
        hook_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE.format(tools=tools))
        saved = {k: os.environ.get(k) for k in (LOG_DIR_ENV, "PYTHONPATH")}
        os.environ[LOG_DIR_ENV] = tmp
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir), saved["PYTHONPATH"]) if p)
        undo = [patch(name, WRAPPERS[name]) for name in TARGETS]
        try:
            run_llm(model, PROMPTS[:n_requests], _params(max_tokens), tp=tp)
        finally:
            for restore in reversed(undo):
                restore()
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        per_rank = {r: _read(Path(tmp) / f"rank{r}.jsonl") for r in range(tp)}
    events = _label_layers(per_rank)
    facts = {f"rank{r}_all_reduces": sum(e["event"] == "all_reduce" for e in rows) for r, rows in per_rank.items()}
    facts["steps"] = sum(e["event"] == "step" for e in per_rank[0])
    facts["tp"] = tp
    return Recording("tp", events, facts)


def _read(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _label_layers(per_rank: Dict[int, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Each all-reduce with its rank, step and place in the step: the embedding's first, then per decoder layer the
    attention output projection and the MLP's down projection (the order the model calls them)."""
    events: List[Dict[str, Any]] = []
    for rank, rows in per_rank.items():
        origin = rows[0]["t0"] if rows else 0.0
        step, index = -1, 0
        for row in rows:
            if row["event"] == "step":
                step, index = step + 1, 0
                continue
            if step < 0:
                continue  # a warm-up before the first scheduled step (none on CPU)
            events.append({"rank": rank, "step": step, "index": index, "caller": row["caller"],
                           "shape": row["shape"], "t_ms": 1e3 * (row["t0"] - origin),
                           "ms": 1e3 * (row["t1"] - row["t0"])})
            index += 1
    return events
