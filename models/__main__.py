"""CLI: ``python -m models prepare smollm2`` / ``python -m models make tiny-qwen3`` / ``python -m models list``."""

from __future__ import annotations

import argparse
import sys

from . import ensure
from .hub import HubUnavailableError, resolve
from .random_models import RANDOM_MODELS, make_random_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="prepare a real-weight model (smollm2)")
    p.add_argument("name", choices=["smollm2"])
    m = sub.add_parser("make", help="make a seeded random model")
    m.add_argument("name", choices=sorted(RANDOM_MODELS) + ["all-tiny"])
    m.add_argument("--device", default="cpu", help="where to build the weights (cuda for full-size shapes)")
    m.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the model's own)")
    m.add_argument("--out", default=None, help="output dir (default: models/<name>, models/<name>-<N>l with --layers)")
    m.add_argument("--layers", type=int, default=None, help="only the first N layers (a shallower copy)")
    r = sub.add_parser("resolve", help="print the local dir of a path, known name or hub id")
    r.add_argument("name")
    sub.add_parser("list", help="list known models")
    args = parser.parse_args(argv)

    try:
        if args.cmd == "prepare":
            print(ensure(args.name))
        elif args.cmd == "make":
            names = [n for n, spec in RANDOM_MODELS.items() if spec.tiny] if args.name == "all-tiny" else [args.name]
            for name in names:
                print(make_random_model(name, device=args.device, dtype=args.dtype, out=args.out, layers=args.layers))
        elif args.cmd == "resolve":
            print(resolve(args.name))
        else:
            print("smollm2 (SmolLM2-135M-Instruct, real weights)")
            for name, spec in RANDOM_MODELS.items():
                print(f"{name}: {spec.description}")
    except (RuntimeError, HubUnavailableError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
