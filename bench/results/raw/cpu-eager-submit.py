"""When a burst's requests reach the scheduler: `python -m bench serve-path` in two checkouts in turn, each run with
the scheduler's step log, and the arrivals read from it against the clients' start.

    python bench/results/raw/cpu-eager-submit.py OUT.json BEFORE_DIR AFTER_DIR [--rounds 3] [--client-procs 1]
        [--step-ms 3]

Each checkout runs its own `stage4_fast` (the burst: 256 streamed requests of 256 tokens, the engine's forward
stubbed with a sleep per step like a GPU step's); both need `bench/serve_path.py` of a version that writes
`clock_s` (the clients' start and end, perf_counter) into its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def arrivals(result: dict, step_log: Path) -> dict:
    """Milliseconds from the clients' start until the first request, half of them and all of them were in the
    scheduler (waiting or running: with 256 output tokens none has finished by then)."""
    t0, n = result["clock_s"][0], result["requests"]
    marks: dict[str, float | None] = {"first_in_ms": None, "half_in_ms": None, "all_in_ms": None}
    for line in step_log.read_text().splitlines():
        row = json.loads(line)
        received_at = row["t"] + row["receive_ms"] / 1e3
        if not row["msgs"] or received_at <= t0:
            continue
        inside = row["pending"] + row["running"]
        for key, needed in (("first_in_ms", 1), ("half_in_ms", n // 2), ("all_in_ms", n)):
            if marks[key] is None and inside >= needed:
                marks[key] = (received_at - t0) * 1e3
    return marks


def run(tree: Path, tmp: Path, tag: str, client_procs: int, step_ms: float) -> dict:
    out, log = tmp / f"{tag}.json", tmp / f"{tag}.steps.jsonl"
    env = dict(os.environ, MINISGL_STEP_LOG=str(log), PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "bench", "serve-path", "--requests", "256", "--output-len", "256",
           "--client-procs", str(client_procs), "--step-ms", str(step_ms), "--json", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True)
    result = json.loads(out.read_text())
    return {"tree": str(tree), "seconds": result["seconds"], "ttft_p50_ms": result["ttft_p50_s"] * 1e3,
            "ttft_p99_ms": result["ttft_p99_s"] * 1e3, **arrivals(result, log)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=3.0)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):  # in turn, the order swapped every round
            order = [("before", args.before), ("after", args.after)]
            for name, tree in order if i % 2 == 0 else order[::-1]:
                measured = run(tree.resolve(), Path(tmp), f"{name}-{i}", args.client_procs, args.step_ms)
                row = {"round": i + 1, "code": name, **measured}
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
