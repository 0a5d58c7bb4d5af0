"""tools/hygiene.py: the repository is clean, and each kind of development leftover is caught (with the wording
neighbours it must not flag)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("hygiene", Path(__file__).resolve().parents[1] / "hygiene.py")
hygiene = importlib.util.module_from_spec(spec)
sys.modules["hygiene"] = hygiene  # dataclasses look their module up by name
spec.loader.exec_module(hygiene)


def test_repository_is_clean():
    assert [str(f) for f in hygiene.scan()] == []


@pytest.mark.parametrize("line", [
    "measured after the issue-7 changes",
    "TP on 2x H200 (issue 8)",
    "the benchmark of the stage2 issue",
    "not built (the issue does not ask for one)",
    "Upstream defects fixed here (interfaces map §19)",
    "see ../shared/GPU_NOTES.md for the wheel",
    "PYTHONPATH=/work/venv/bin/python tools/gpu_check.sh download",
    "rootdir: /work/main",
    "results land in $OUT as they come",
    'run(command="bash x", carry=[".whl"])',
    "flashinfer 0.5.3 (carried wheels)",
    "Not re-measured on the GPU (no device time left)",
    "in one device call",
    "export NCCL_NVLS_ENABLE=0  # the machine's rules",
    "# H200 results (kind `nvidia-h200-x2`)",
    "Re-check (second session, 15:15 UTC)",
    "Device time used: ~23 of the session's 30 minutes",
    "(wip/capstone/tools/check_margins.py)",
])
def test_leftovers_are_caught(line):
    assert hygiene.scan_text("f.md", line), line


@pytest.mark.parametrize("line", [
    "nox -s gpu: the GPU session",
    '@pytest.fixture(scope="session")',
    "start_new_session=True",
    "state carried across chunks (the carry of the conv)",
    "a per-step prefill token budget",
    "1× NVIDIA H200, driver 580",
    "results/h200x2.md, bench/gpu_notes.md",
    "out=${OUT:-/tmp/gpu_check}",
    "an issue of the upstream repository: https://github.com/sgl-project/mini-sglang/issues/12",
    "Line numbers are upstream's python/minisgl/ at commit 20fcd7f (scheduler/scheduler.py:153)",
    "/tmp/work/hf and ~/work/x are other machines' scratch paths",
])
def test_ordinary_wording_passes(line):
    assert hygiene.scan_text("f.md", line) == [], line


def test_only_tracked_text_files_are_read(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "notes.md").write_text("see issue 3\n")
    (tmp_path / "plot.png").write_bytes(b"\x89PNG\0\0 issue 3")
    (tmp_path / "untracked.md").write_text("see issue 4\n")
    subprocess.run(["git", "add", "notes.md", "plot.png"], cwd=tmp_path, check=True)
    found = hygiene.scan(tmp_path)
    assert [(f.path, f.line) for f in found] == [("notes.md", 1)]
