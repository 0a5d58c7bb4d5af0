"""What every benchmark records about its run — date, command, code, versions, machine, load — and the percentile
rule, in one place for every `python -m bench` command. Imports nothing heavy (the parent of a run stays light)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"  # the committed results; written only when asked (--out bench/results)
LOCAL = ROOT / "bench" / "local"  # where a run writes by default (gitignored)
GPU_PACKAGES = ("triton", "flashinfer-python", "apache-tvm-ffi", "flash-attn-4")


def now() -> str:
    return dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def command(prog: str, argv: list[str]) -> str:
    return " ".join([prog, *argv])


def load() -> str:
    """1/5/15-minute load averages."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def git_commit() -> str:
    """HEAD's short hash, marked when tracked files differ from it (the figures then belong to no commit)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if not head:
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes" if dirty else "")


def versions(gpu: bool = False) -> str:
    out = [f"python {platform.python_version()}"]
    for pkg in ("torch", "transformers", *(GPU_PACKAGES if gpu else ())):
        try:
            out.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def gpus() -> list[str]:
    """Names of the NVIDIA GPUs (nvidia-smi), one per device; [] without one."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def hardware(gpu_names: list[str] | None = None) -> str:
    """CPU model, usable cores, RAM, and the GPUs if any: `Xeon ..., 2 cores, 24 GiB RAM; 1× NVIDIA H200`."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    text = f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores, {mem:.0f} GiB RAM"
    return text + (f"; {len(gpu_names)}× {gpu_names[0]}" if gpu_names else "")


def machine_key(gpu_names: list[str], gpu: bool) -> str:
    """Results file name of a machine: `cpu`, or the GPU model's number (`h200`, `h200-x2` for two)."""
    if not gpu:
        return "cpu"
    name = gpu_names[0] if gpu_names else "gpu"
    key = next((t for t in name.lower().replace("-", " ").split() if any(c.isdigit() for c in t)), "gpu")
    return key + (f"-x{len(gpu_names)}" if len(gpu_names) > 1 else "")


def run_meta(prog: str, argv: list[str], gpu: bool = False) -> dict:
    """The header fields every results file carries."""
    names = gpus() if gpu else []
    return {"date": now(), "command": command(prog, argv), "git": git_commit(), "versions": versions(gpu),
            "hardware": hardware(names)}


def header_lines(run_info: dict) -> list[str]:
    """The date and code, machine and command lines that open a report (``run_info`` from ``run_meta``)."""
    return [f"- date: {run_info['date']}; code: {run_info['git']}", f"- machine: {run_info['hardware']}",
            f"- command: `{run_info['command']}`"]


def write_report(out: Path, text: str) -> None:
    """Write a markdown report (its folder created) and show it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank on the sorted values."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def relative(path: Path | str) -> str:
    """A path as the results files print it: relative to the repository when inside it (no machine's own paths)."""
    path = Path(os.path.abspath(path))  # not resolve(): a prepared model may be a symlink to a shared copy
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)
