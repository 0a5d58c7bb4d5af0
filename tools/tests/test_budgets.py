"""tools/budgets.py on small fake trees: each budget passes at its limit, fails one past it, and says so in the
"<what>: <number> (budget <budget>)" form; commit subjects are read after the base commit, shallow clones too."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("budgets_tool", Path(__file__).resolve().parents[1] / "budgets.py")
budgets = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = budgets  # dataclasses look their module up
spec.loader.exec_module(budgets)

MAP = """
[stage4.small]
about = "a small topic"
claims = ["small.py"]

[stage4.big]
about = "a big topic"
claims = ["big/*"]
"""


def function(name: str, lines: int) -> str:
    """A function of exactly `lines` lines."""
    return f"def {name}():\n" + "    x = 1\n" * (lines - 2) + "    return x\n"


def write(root: Path, rel: str, text: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)


def make_tree(root: Path) -> Path:
    """Two stages and the bench folder, every measure within its budget."""
    write(root, "tools/chapters.toml", MAP)
    for stage in ("stage3_served", "stage4_fast"):
        write(root, f"{stage}/__init__.py", "")
        write(root, f"{stage}/README.md", "# a stage\n")
        write(root, f"{stage}/tests/test_x.py", function("test_long", 200))  # tests are not held to the budgets
    write(root, "stage4_fast/small.py", function("f", 80))
    write(root, "stage4_fast/env.py", 'A = EnvVar("ONE", 0, int)\nB = "MINISGL_TWO"\nC = "MINISGL_TEST_THREE"\n')
    write(root, "stage4_fast/big/a.py", "# see bench/results/x.md\n" * 3)
    write(root, "README.md", "x" * 25_000)
    write(root, "bench/results/a.md", "results\n")
    return root


def over(root: Path) -> list[str]:
    """The measures that fail lint."""
    return [str(m) for m in budgets.measure_all(root) if m.over]


def test_a_tree_within_every_budget_passes_and_the_report_has_a_line_per_budget(tmp_path):
    root = make_tree(tmp_path)
    assert over(root) == []
    assert budgets.env_names(root) == ["MINISGL_ONE", "MINISGL_TWO"]  # _TEST_ names left out
    lines = budgets.report(budgets.measure_all(root))
    assert len(lines) == len(budgets.BUDGETS)
    assert all(line.lstrip().startswith("ok") for line in lines)
    assert any("bench/gpu_notes.md: not measured, no such file" in line for line in lines)
    assert any("commit subject" in line and "not measured" in line for line in lines)  # no git checkout
    assert any("function stage4_fast/small.py::f (lines): 80 (budget 80)" in line for line in lines)


@pytest.mark.parametrize("rel, size, message", [
    ("stage4_fast/README.md", 30_001, "stage4_fast/README.md (bytes): 30001 (budget 30000)"),
    ("stage3_served/README.md", 25_001, "stage3_served/README.md (bytes): 25001 (budget 25000)"),
    ("bench/README.md", 25_001, "bench/README.md (bytes): 25001 (budget 25000)"),
    ("bench/gpu_notes.md", 10_001, "bench/gpu_notes.md (bytes): 10001 (budget 10000)"),
    ("bench/results/big.bin", 1_500_001, "bench/results size (bytes): 1500009 (budget 1500000)"),
])
def test_files_over_their_size(tmp_path, rel, size, message):
    root = make_tree(tmp_path)
    write(root, rel, "x" * size)
    assert over(root) == [message]


def test_too_many_result_files(tmp_path):
    root = make_tree(tmp_path)
    for i in range(25):
        write(root, f"bench/results/r{i}.md", "r\n")
    assert over(root) == ["bench/results tracked files: 26 (budget 25)"]


def test_modules_functions_and_the_fast_stages_lines(tmp_path):
    root = make_tree(tmp_path)
    write(root, "stage3_served/long.py", "x = 1\n" * 501)
    write(root, "stage4_fast/small.py", "class C:\n" + "".join("    " + line + "\n" for line in
                                                             function("method", 81).splitlines()))
    assert over(root) == ["module stage3_served/long.py (lines): 501 (budget 500)",
                          "function stage4_fast/small.py::C.method (lines): 81 (budget 80)"]
    write(root, "stage3_served/long.py", "x = 1\n" * 500)
    write(root, "stage4_fast/small.py", function("f", 80))
    for i in range(28):
        write(root, f"stage4_fast/part{i}.py", "x = 1\n" * 450)
    lines = next(m.value for m in budgets.measure_all(root) if m.budget.key == "fast_lines")
    write(root, "stage4_fast/rest.py", "x = 1\n" * (13_000 - lines))
    assert over(root) == []
    write(root, "stage4_fast/one_more.py", "x = 1\n")
    assert over(root) == ["stage4_fast non-test .py lines: 13001 (budget 13000)"]


def test_env_names_and_notes_mentions(tmp_path):
    root = make_tree(tmp_path)
    names = "".join(f'N{i} = "MINISGL_NAME_{i}"\n' for i in range(7))
    write(root, "stage4_fast/more_env.py", names + "# gpu_notes.md says so\n")
    assert sorted(over(root)) == ["distinct MINISGL_* names in stage4_fast: 9 (budget 8)",
                                  "non-test source lines naming bench/results or gpu_notes: 4 (budget 3)"]


def test_a_stage4_topic_over_its_diff_lines(tmp_path):
    root = make_tree(tmp_path)
    for i in range(6):
        write(root, f"stage4_fast/big/m{i}.py", "x = 1\n" * 417)  # 6 * 417 + 3 = 2505 lines, tests left out
    write(root, "stage4_fast/tests/test_big.py", "x = 1\n" * 3000)
    assert over(root) == ["stage4 topic big (diff lines without tests): 2505 (budget 2500)"]


# -- commit subjects -----------------------------------------------------------------------------------------------
def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=root,
                          capture_output=True, text=True, check=True).stdout.strip()


def commit(root: Path, subject: str) -> str:
    (root / "log.txt").write_text((root / "log.txt").read_text() + subject + "\n" if (root / "log.txt").exists()
                                  else subject + "\n")
    git(root, "add", "log.txt")
    git(root, "commit", "-q", "-m", subject)
    return git(root, "rev-parse", "--short", "HEAD")


@pytest.fixture
def history(tmp_path):
    """old (long subject) -> base -> fine -> long; a side branch merged with a long merge subject."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    commit(root, "o" * 90)  # before the base: not checked
    base = commit(root, "the base")
    commit(root, "Add a feature")
    git(root, "checkout", "-q", "-b", "side")
    side = commit(root, "s" * 73)
    git(root, "checkout", "-q", "main")
    (root / "other.txt").write_text("x\n")
    git(root, "add", "other.txt")
    git(root, "commit", "-q", "-m", "Add another file")
    git(root, "merge", "-q", "--no-ff", "side", "-m", "m" * 80)
    return root, base, side


def test_commit_subjects_after_the_base_merges_included(history, monkeypatch):
    root, base, side = history
    monkeypatch.setattr(budgets, "BASE_COMMIT", base)
    found = [str(m) for m in budgets.subject_measures(root) if m.over]
    merge = git(root, "rev-parse", "--short", "HEAD")
    assert sorted(found) == sorted([f"commit {merge} subject (characters): 80 (budget 72)",
                                    f"commit {side} subject (characters): 73 (budget 72)"])


def test_a_shallow_clone_without_the_base_checks_what_it_has(history, tmp_path, monkeypatch):
    root, base, _ = history
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{root}", str(clone)], check=True)
    monkeypatch.setattr(budgets, "BASE_COMMIT", base)
    assert [m.value for m in budgets.subject_measures(clone)] == [80]  # the merge alone is in the clone
    monkeypatch.setattr(budgets, "BASE_COMMIT", "0" * 40)  # a full history without the base: nothing to tell
    assert budgets.commits_to_check(root) is None
    assert budgets.subject_measures(root) == []


def test_main_fails_with_the_measures_over_budget(tmp_path, monkeypatch, capsys):
    root = make_tree(tmp_path)
    monkeypatch.setattr(budgets, "REPO", root)
    assert budgets.main([]) == 0
    assert capsys.readouterr().out == "budgets: every measure within its budget\n"
    write(root, "stage3_served/long.py", "x = 1\n" * 501)
    assert budgets.main(["--report"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("budgets (tools/budgets.py):\n")
    assert out.endswith("\nmodule stage3_served/long.py (lines): 501 (budget 500)\n")
    assert "  OVER  module stage3_served/long.py (lines): 501 (budget 500)  [the largest of" in out
