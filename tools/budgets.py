"""Size budgets: the limits that keep the book readable, checked as part of `nox -s lint`.

    python tools/budgets.py            # exit 1 and print "<what>: <number> (budget <budget>)" for each one over
    python tools/budgets.py --report   # every measure with its budget, over or not

The budgets are the table BUDGETS below. A family of measures (every module, every function, every stage4 topic,
every commit subject) fails once per member over its budget; the report gives the family's largest member.

Commit subjects are those of `git log BASE_COMMIT..HEAD`, merge commits included (a merge's subject is read in the
log like any other). A shallow clone that lacks BASE_COMMIT holds only commits after it, so all of them are
checked; a full history without it (another project's history, an export) is not checked, and a tree that is no
git checkout has no commits to check.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chapters  # noqa: E402  (tools/ is not a package)

REPO = Path(__file__).resolve().parents[1]
BASE_COMMIT = "dec7340"  # the commit subjects after this one are held to the subject budget
FAST_STAGE = "stage4_fast"



@dataclass(frozen=True)
class Budget:
    key: str
    what: str  # what is measured, as the messages name it
    limit: int
    unit: str


BUDGETS: Dict[str, Budget] = {b.key: b for b in [
    Budget("fast_readme", f"{FAST_STAGE}/README.md", 30_000, "bytes"),
    Budget("readme", "any other README.md", 25_000, "bytes"),
    Budget("results_files", "bench/results tracked files", 25, "files"),
    Budget("results_bytes", "bench/results size", 1_500_000, "bytes"),
    Budget("gpu_notes", "bench/gpu_notes.md", 10_000, "bytes"),
    Budget("fast_lines", f"{FAST_STAGE} non-test .py lines", 13_000, "lines"),
    Budget("module", "a non-test module of a stage", 500, "lines"),
    Budget("function", "a non-test function of a stage", 80, "lines"),
    Budget("env_names", f"distinct MINISGL_* names in {FAST_STAGE} (test-only _TEST_ names left out)", 8, "names"),
    Budget("results_mentions", "non-test source lines naming bench/results or gpu_notes", 3, "lines"),
    Budget("topic", "a stage4 topic's diff lines without tests (+ and -)", 2_500, "lines"),
    Budget("subject", f"a commit subject after {BASE_COMMIT}", 72, "characters"),
]}


@dataclass(frozen=True)
class Measure:
    key: str  # its budget's key
    what: str
    value: int

    @property
    def budget(self) -> Budget:
        return BUDGETS[self.key]

    @property
    def over(self) -> bool:
        return self.value > self.budget.limit

    def __str__(self) -> str:
        return f"{self.what}: {self.value} (budget {self.budget.limit})"


# -- files -------------------------------------------------------------------------------------------------------
def _git(root: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def tracked(root: Path, folder: str = ".") -> List[str]:
    """Files under folder (relative to root) that git tracks; every file there when root is no git checkout."""
    out = _git(root, "ls-files", "-z", "--", folder)
    if out is None:
        base = root / folder
        return sorted(p.relative_to(root).as_posix() for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
    return [n for n in out.split("\0") if n and (root / n).is_file()]


def source_files(root: Path) -> Dict[str, List[str]]:
    """Each stage's non-test .py files, relative to the repository root."""
    return {d.name: [f"{d.name}/{n}" for n in chapters.stage_files(d) if n.endswith(".py") and
                     not chapters.is_test_or_readme(n)] for d in chapters.stage_dirs(root).values()}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8", errors="replace").splitlines())


# -- the measures ------------------------------------------------------------------------------------------------
def readme_measures(root: Path) -> List[Measure]:
    out = []
    for rel in tracked(root):
        if rel.rsplit("/", 1)[-1] == "README.md":
            key = "fast_readme" if rel == f"{FAST_STAGE}/README.md" else "readme"
            out.append(Measure(key, f"{rel} (bytes)", (root / rel).stat().st_size))
    return out


def results_measures(root: Path) -> List[Measure]:
    files = tracked(root, "bench/results")
    out = [Measure("results_files", "bench/results tracked files", len(files)),
           Measure("results_bytes", "bench/results size (bytes)", sum((root / f).stat().st_size for f in files))]
    notes = root / "bench" / "gpu_notes.md"
    if notes.is_file():
        out.append(Measure("gpu_notes", "bench/gpu_notes.md (bytes)", notes.stat().st_size))
    return out


def function_lengths(text: str) -> Dict[str, int]:
    """Each function's qualified name -> its lines, decorators left out (a nested function also counts in its
    parent's)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    out: Dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}" if prefix else child.name
                if not isinstance(child, ast.ClassDef):
                    out[name] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, name)
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def code_measures(root: Path) -> List[Measure]:
    """Module and function lengths, the fast stage's total, and source lines that point at the bench notes."""
    out, mentions = [], 0
    for stage, files in source_files(root).items():
        total = 0
        for rel in files:
            text = (root / rel).read_text(encoding="utf-8", errors="replace")
            lines = text.splitlines()
            total += len(lines)
            out.append(Measure("module", f"module {rel} (lines)", len(lines)))
            out += [Measure("function", f"function {rel}::{name} (lines)", n)
                    for name, n in function_lengths(text).items()]
            mentions += sum(bool(re.search(r"bench/results|gpu_notes", line)) for line in lines)
        if stage == FAST_STAGE:
            out.append(Measure("fast_lines", f"{FAST_STAGE} non-test .py lines", total))
    out.append(Measure("results_mentions", "non-test source lines naming bench/results or gpu_notes", mentions))
    return out


_ENV_LITERAL = re.compile(r"\bMINISGL_[A-Z0-9_]*[A-Z0-9]\b")
_ENV_DECLARED = re.compile(r"""\bEnvVar\(\s*["']([A-Z0-9_]+)["']""")  # env.py's EnvVar("NAME") reads MINISGL_NAME


def env_names(root: Path) -> List[str]:
    names = set()
    for rel in tracked(root, FAST_STAGE):
        if not rel.endswith((".py", ".md", ".sh", ".toml")):
            continue
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        names |= set(_ENV_LITERAL.findall(text)) | {f"MINISGL_{n}" for n in _ENV_DECLARED.findall(text)}
    return sorted(n for n in names if "_TEST_" not in n)


def topic_measures(root: Path) -> List[Measure]:
    stage = max(chapters.stage_dirs(root), default=None)
    if stage is None or stage - 1 not in chapters.stage_dirs(root):
        return []
    chapter = chapters.chapter_for(root, stage - 1, stage)
    sizes = {name: 0 for name in chapter.topics}
    for fd in chapters.pair_diff(root, stage - 1, stage, "code"):
        for hunk in fd.hunks:
            for name in chapter.owners(hunk):
                sizes[name] += len(hunk.added) + len(hunk.removed)
    return [Measure("topic", f"stage{stage} topic {name} (diff lines without tests)", n) for name, n in sizes.items()]


def commits_to_check(root: Path, base: str | None = None) -> List[str] | None:
    """`sha subject` of the commits after base (BASE_COMMIT; merges too); None when they cannot be told (see the
    docstring)."""
    base = base or BASE_COMMIT
    if _git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}") is None:
        return None
    if _git(root, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}") is not None:
        out = _git(root, "log", "--format=%h %s", f"{base}..HEAD")
    elif (_git(root, "rev-parse", "--is-shallow-repository") or "").strip() == "true":
        out = _git(root, "log", "--format=%h %s", "HEAD")  # the clone was cut after base: all of it is newer
    else:
        return None
    return [line for line in (out or "").splitlines() if line]


def subject_measures(root: Path) -> List[Measure]:
    out = []
    for line in commits_to_check(root) or []:
        sha, _, subject = line.partition(" ")
        out.append(Measure("subject", f"commit {sha} subject (characters)", len(subject)))
    return out


def measure_all(root: Path = REPO) -> List[Measure]:
    names = env_names(root)
    return (readme_measures(root) + results_measures(root) + code_measures(root)
            + [Measure("env_names", f"distinct MINISGL_* names in {FAST_STAGE}", len(names))]
            + topic_measures(root) + subject_measures(root))


# -- output ------------------------------------------------------------------------------------------------------
FAMILIES = {"readme": "READMEs", "module": "modules", "function": "functions", "topic": "topics",
            "subject": "commits"}


def report(measures: List[Measure]) -> List[str]:
    """One line per budget, used or not: its measure, or a family's largest member and how many are over."""
    lines = []
    for key, budget in BUDGETS.items():
        family = [m for m in measures if m.key == key]
        if not family:
            why = {"gpu_notes": "no such file", "subject": "no commits to check in this checkout"}.get(key, "nothing")
            lines.append(f"  ok    {budget.what}: not measured, {why} (budget {budget.limit})")
            continue
        top = max(family, key=lambda m: m.value)
        over = sum(m.over for m in family)
        tail = f"  [the largest of {len(family)} {FAMILIES[key]}, {over} over]" if key in FAMILIES else ""
        lines.append(f"  {'OVER' if over else 'ok':<5} {top}{tail}")
    return lines


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tools/budgets.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="print every measure with its budget")
    args = parser.parse_args(argv)
    try:
        measures = measure_all(REPO)
    except chapters.StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failing = [m for m in measures if m.over]
    if args.report:
        print("budgets (tools/budgets.py):")
        print("\n".join(report(measures)))
        if failing:
            print()
    print("\n".join(map(str, failing)) if failing else "budgets: every measure within its budget")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
