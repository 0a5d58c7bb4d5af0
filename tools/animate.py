"""Animations made from real runs: ``python tools/animate.py NAME [--out DIR]`` runs a stage on the CPU, records
what its scheduler, cache, workers or ranks did, and draws that into an animated GIF.

    python tools/animate.py all                      # the six, with models/SmolLM2-135M-Instruct
    python tools/animate.py radix-cache --model tiny-qwen3 --out /tmp/anim

NAME: request-life, continuous-batching, radix-cache, overlap, tp, cuda-graph (or all). The model is a directory or
a name under models/ (``python -m models prepare smollm2``, ``python -m models make tiny-qwen3``). Each GIF comes with
its recorded events as JSON next to it (NAME.events.json). The recorders wrap stage methods for the run's length
only; the methods they wrap are listed in tools/animations/hooks.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from animations import NAMES, RECORDERS  # noqa: E402
from animations.frames import build, thin  # noqa: E402

DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"
DEFAULT_OUT = REPO / "bench" / "local" / "animations"


def resolve_model(model: str) -> str:
    for candidate in (Path(model), REPO / model, REPO / "models" / model):
        if (candidate / "config.json").exists():
            return str(candidate.resolve())
    raise SystemExit(f"no model at {model!r}: prepare one with `python -m models prepare smollm2` or "
                     "`python -m models make tiny-qwen3`")


def make(name: str, model: str, out: Path, max_frames: int = 60, size: tuple = (8.0, 4.5), dpi: int = 80,
         fps: float = 2.0) -> dict:
    """Record, build the frames, render: a summary of what was written."""
    from animations.render import render

    start = time.perf_counter()
    rec = RECORDERS[name](model)
    frames = build(rec)
    shown = thin(frames, max_frames)
    path = render(name, shown, out / f"{name}.gif", size=size, dpi=dpi, fps=fps)
    (out / f"{name}.events.json").write_text(json.dumps({"events": rec.events, "facts": rec.facts}, default=str))
    return {"name": name, "path": str(path), "bytes": path.stat().st_size, "events": len(rec.events),
            "frames": len(frames), "frames_drawn": len(shown), "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=[*NAMES, "all"])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the GIFs (bench/local/animations)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a model directory, or a name under models/")
    ap.add_argument("--max-frames", type=int, default=60, help="frames drawn at most, evenly spaced over the run")
    ap.add_argument("--fps", type=float, default=2.0)
    args = ap.parse_args(argv)
    model = resolve_model(args.model)
    for name in NAMES if args.name == "all" else [args.name]:
        summary = make(name, model, args.out, max_frames=args.max_frames, fps=args.fps)
        print(f"{summary['path']}: {summary['frames_drawn']} frames ({summary['frames']} recorded, "
              f"{summary['events']} events), {summary['bytes'] / 1024:.0f} KiB, {summary['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
