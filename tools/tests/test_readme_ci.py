"""The README's quick start and CI agree: .ci/run runs exactly the README's test command line, and a machine without
a GPU learns to install the CPU build of torch before it reaches the two lines."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _quick_start_blocks() -> list[list[str]]:
    """The command lines of each bash block of the Quick start section, in order."""
    section = (REPO / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [[line for line in block.strip().splitlines() if line and not line.startswith("#")] for block in blocks]


def quick_start_lines() -> list[str]:
    """The fresh machine's two lines: the section's last block."""
    return _quick_start_blocks()[-1]


def test_quick_start_has_exactly_two_lines():
    lines = quick_start_lines()
    assert len(lines) == 2
    assert lines[0].endswith("python -m stage4_fast.serve") and lines[1].endswith("&& nox")


def test_the_cpu_build_comes_before_the_two_lines():
    """A reader without a GPU meets the CPU build's line first; it pins the two lines' torch version, so their
    `pip install torch==X` keeps the CPU build (X+cpu satisfies ==X) instead of fetching the CUDA wheel."""
    blocks = _quick_start_blocks()
    assert len(blocks) == 2 and len(blocks[0]) == 1
    cpu_line = blocks[0][0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu_line
    pin = re.search(r"torch==(\S+)", cpu_line).group(1)
    assert all(f"torch=={pin} " in line for line in quick_start_lines())


def test_ci_runs_the_readme_test_line():
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines == [quick_start_lines()[1]]
