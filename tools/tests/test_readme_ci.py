"""The README's quick start and CI agree: .ci/run runs exactly the README's test command line."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def quick_start_lines() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if line and not line.startswith("#")]


def test_quick_start_has_exactly_two_lines():
    assert len(quick_start_lines()) == 2


def test_ci_runs_the_readme_test_line():
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines == [quick_start_lines()[1]]
