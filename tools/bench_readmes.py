"""Copy benchmark figures from the committed results files into the READMEs, so every figure a README quotes comes
from `bench/results/` (run after `python -m bench --out bench/results`).

    python tools/bench_readmes.py          # rewrite the marked blocks
    python tools/bench_readmes.py --check  # exit 1 if a README is out of date

A README opts in with a block between `<!-- bench:NAME -->` and `<!-- /bench -->`; NAME picks what goes in
(see BLOCKS). Text outside the markers is never touched.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MARK = re.compile(r"(<!-- bench:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench -->)", re.S)


def _table(md: str, heading: str) -> list[str]:
    """The markdown table under `## heading` of a results file, as its lines."""
    part = md.split(f"## {heading}", 1)[1]
    return [line for line in part.split("\n## ", 1)[0].splitlines() if line.startswith("|")]


def _stage_rows(md: str, engines: list[str]) -> str:
    lines = _table(md, "Stages")
    head, rows = lines[:2], lines[2:]
    rows = [r for r in rows if r.split("|")[1].strip() in engines]
    return "\n".join(head + rows)


def _meta_line(name: str) -> str:
    md = (RESULTS / f"{name}.md").read_text()
    date = re.search(r"- date: ([^;\n]+)", md)
    command = re.search(r"- command: `([^`]+)`", md)
    machine = re.search(r"- machine: ([^;\n]+)", md)
    return (f"From [`bench/results/{name}.md`](../bench/results/{name}.md) — `{command.group(1).strip()}`, "
            f"{date.group(1).strip()}, {machine.group(1).strip()}:")


def block(name: str, readme: Path) -> str:
    cpu = (RESULTS / "cpu.md").read_text()
    up = "" if readme.parent == ROOT else "../"
    meta = _meta_line("cpu").replace("../bench/", f"{up}bench/")
    stages = {"stage0": ["HF transformers", "stage0_tiny"],
              "stage1": ["HF transformers", "stage0_tiny", "stage1_correct"],
              "stage2": ["HF transformers", "stage1_correct", "stage2_scheduled"],
              "stage3": ["stage2_scheduled", "stage3_served"], "stage4": ["stage3_served", "stage4_fast"]}
    if name in stages:
        return f"{meta}\n\n{_stage_rows(cpu, stages[name])}\n"
    if name == "all":
        rows = "\n".join(_table(cpu, "Stages"))
        abl = "\n".join(_table(cpu, "Ablations"))
        plots = "\n".join(f"![{p}]({up}bench/results/{p})" for p in
                          ("cpu_throughput.png", "cpu_latency.png", "cpu_ablations.png"))
        return f"{meta}\n\n{rows}\n\n{abl}\n\n{plots}\n"
    if name == "ablations":
        return f"{meta}\n\n" + "\n".join(_table(cpu, "Ablations")) + "\n"
    raise SystemExit(f"{readme}: unknown bench block {name!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for readme in [ROOT / "README.md", *sorted(ROOT.glob("stage*/README.md"))]:
        text = readme.read_text()
        new = MARK.sub(lambda m, r=readme: m.group(1) + block(m.group("name"), r) + m.group(4), text)
        if new != text:
            stale.append(readme.relative_to(ROOT))
            if not args.check:
                readme.write_text(new)
    verb = "out of date" if args.check else "updated"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "all bench blocks current")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
