"""Every benchmark block of a README equals what tools/bench_readmes.py makes from the committed results files."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_readme_bench_blocks_match_the_results_files():
    proc = subprocess.run([sys.executable, "tools/bench_readmes.py", "--check"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_readme_has_a_bench_block():
    for readme in [REPO / "README.md", *sorted(REPO.glob("stage*/README.md"))]:
        assert "<!-- bench:" in readme.read_text(), f"{readme.relative_to(REPO)} has no benchmark block"
