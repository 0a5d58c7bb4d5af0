"""Exercises: write a piece of a stage yourself, and let its tests say when it is right.

    python tools/exercises.py list                 # every exercise: stage, what to write
    python tools/exercises.py start radix-evict    # scratch/radix-evict/: the stage with those bodies removed
    python tools/exercises.py check radix-evict    # run the exercise's tests on your scratch copy
    python tools/exercises.py show radix-evict     # what to write, the hint, the tests (again)
    python tools/exercises.py verify               # CI: every exercise's tests pass on the stage, fail on its copy

`start` copies the exercise's stage into a scratch folder (``scratch/NAME`` unless ``--dir``), with the bodies of the
exercise's functions replaced by ``raise NotImplementedError`` (their signatures and docstrings stay, and a comment
gives a hint). `models/` and the shared suite are linked in, so the stage's own tests run there unchanged; `check`
runs the exercise's tests on the scratch copy (they pass on the stage as shipped, and fail on the fresh copy).
The exercises are defined in ``tools/exercises.toml``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
EXERCISES_FILE = REPO / "tools" / "exercises.toml"
SCRATCH = REPO / "scratch"
# what a scratch copy needs beside the stage: the root conftest (--stage), pytest's settings, the model makers and
# prepared models (linked), the shared suite (some exercises are checked by it)
LINKED = ("models", "shared_tests")
COPIED = ("conftest.py", "pyproject.toml")
TEST_TIMEOUT_S = 120  # verify: a test that hangs on a removed body fails instead


class ExerciseError(Exception):
    """A user error: the message is shown as is."""


@dataclass(frozen=True)
class Exercise:
    name: str
    stage: str
    blank: List[str]  # "path/in/stage.py::Qual.name"
    hint: str
    tests: List[str]  # pytest node ids, relative to the repository root

    def describe(self) -> str:
        lines = [f"{self.name} ({self.stage})", "  write:"]
        lines += [f"    {self.stage}/{target.replace('::', '  ')}" for target in self.blank]
        lines += ["  hint:", *(f"    {line}" for line in _wrap(self.hint, 100))]
        lines += ["  tests:", *(f"    {t}" for t in self.tests)]
        return "\n".join(lines)


def _wrap(text: str, width: int) -> List[str]:
    import textwrap

    return textwrap.wrap(" ".join(text.split()), width)


def load(path: Path = EXERCISES_FILE) -> Dict[str, Exercise]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    data = tomllib.loads(path.read_text())
    exercises = {}
    for name, body in data.items():
        unknown = set(body) - {"stage", "blank", "hint", "tests"}
        if unknown:
            raise ExerciseError(f"{path.name}: [{name}] has unknown key(s) {sorted(unknown)}")
        exercises[name] = Exercise(name, body["stage"], list(body["blank"]), body["hint"], list(body["tests"]))
    return exercises


def get(name: str) -> Exercise:
    exercises = load()
    if name not in exercises:
        raise ExerciseError(f"no exercise {name!r} (python tools/exercises.py list shows them)")
    return exercises[name]


# -- blanking ------------------------------------------------------------------------------------------------------
def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    body: list = tree.body
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            raise ExerciseError(f"no {qualname} (missing {part!r})")
        body = node.body
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ExerciseError(f"{qualname} is not a function")
    return node


def blank_source(source: str, qualnames: List[str], exercise: str, hint: str) -> str:
    """The source with each named function's body replaced by ``raise NotImplementedError``: the signature and the
    docstring stay, the hint comes as a comment. A generator stays a generator (an unreachable ``yield``)."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    cuts = []
    for qualname in qualnames:
        node = _find(tree, qualname)
        body = node.body
        if body[0].lineno == node.lineno:
            raise ExerciseError(f"{qualname}: a one-line function cannot be blanked")
        doc = ast.get_docstring(node, clean=False) is not None
        if doc and len(body) == 1:
            raise ExerciseError(f"{qualname} has nothing but a docstring")
        if doc:
            start = body[0].end_lineno  # right after the docstring (0-based index of the next line)
        else:  # right after the signature: skip back over comments above the first statement
            start = body[0].lineno - 1
            while start > node.lineno and (not lines[start - 1].strip() or lines[start - 1].strip().startswith("#")):
                start -= 1
        indent = " " * body[0].col_offset
        new = [f"{indent}# Exercise {exercise}: write this body.\n"]
        new += [f"{indent}# {line}\n" for line in _wrap(hint, 110 - len(indent))]
        new.append(f"{indent}raise NotImplementedError({f'exercise {exercise}: {qualname}'!r})\n")
        if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_nodes(node)):
            new.append(f"{indent}yield  # (keeps this function a generator)\n")
        cuts.append((start, node.end_lineno, new))
    for start, end, new in sorted(cuts, reverse=True):
        lines[start:end] = new
    return "".join(lines)


def _own_nodes(func: ast.AST):
    """The function's nodes, not those of functions nested in it."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


# -- start / check ---------------------------------------------------------------------------------------------------
def scratch_dir(ex: Exercise, directory: Path | None) -> Path:
    return (directory or SCRATCH / ex.name).resolve()


def start(ex: Exercise, directory: Path | None = None, force: bool = False) -> Path:
    dest = scratch_dir(ex, directory)
    if dest.exists():
        if not force:
            raise ExerciseError(f"{dest} exists (your work?): check it, or start again with --force")
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copytree(REPO / ex.stage, dest / ex.stage, ignore=shutil.ignore_patterns("__pycache__"))
    for name in LINKED:
        (dest / name).symlink_to(REPO / name, target_is_directory=True)
    for name in COPIED:
        shutil.copy2(REPO / name, dest / name)
    by_file: Dict[str, List[str]] = {}
    for target in ex.blank:
        path, _, qualname = target.partition("::")
        by_file.setdefault(path, []).append(qualname)
    for path, qualnames in by_file.items():
        file = dest / ex.stage / path
        file.write_text(blank_source(file.read_text(), qualnames, ex.name, ex.hint))
    return dest


def check(ex: Exercise, directory: Path | None = None, quiet: bool = False) -> subprocess.CompletedProcess:
    """Run the exercise's tests in the scratch copy (its packages first on the path)."""
    dest = scratch_dir(ex, directory)
    if not (dest / ex.stage).is_dir():
        raise ExerciseError(f"{dest} has no {ex.stage}: run `python tools/exercises.py start {ex.name}` first")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(dest), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "pytest", *ex.tests, "-x", "-q", "-p", "no:cacheprovider", "--no-header",
           "-W", "ignore::pytest.PytestConfigWarning"]
    return subprocess.run(cmd, cwd=dest, env=env, text=True, capture_output=quiet)


# -- verification (CI) ----------------------------------------------------------------------------------------------
class _Reports:
    """A pytest plugin that keeps the failure reports of a run."""

    def __init__(self) -> None:
        self.text = ""

    def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001 (pytest's TestReport)
        if report.failed:
            self.text += f"{report.nodeid}\n{report.longreprtext}\n"


def _drop_modules(names: tuple) -> None:
    for module in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[module]


def _pytest_in(root: Path, tests: List[str], stages: tuple) -> tuple[int, str]:
    """pytest.main on `tests` with `root` as the working directory and first on the path, in this process (torch and
    the test dependencies stay imported between runs; the stage packages are dropped before and after)."""
    import pytest

    local = stages + ("shared_tests", "models", "conftest")
    _drop_modules(local)
    cwd, path = os.getcwd(), sys.path[:]
    os.chdir(root)
    sys.path.insert(0, str(root))
    reports = _Reports()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the reports say all that matters
            code = pytest.main([*tests, "-x", "-q", "-p", "no:cacheprovider", "-o", f"timeout={TEST_TIMEOUT_S}",
                                "-W", "ignore::pytest.PytestConfigWarning"], plugins=[reports])
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        _drop_modules(local)
    return int(code), reports.text


def verify(names: List[str] | None = None) -> List[str]:
    """Every exercise's tests pass on its stage and fail, at the removed code, on its fresh scratch copy."""
    import tempfile

    exercises = load()
    chosen = [exercises[n] for n in names] if names else list(exercises.values())
    stages = tuple(sorted({p.name for p in REPO.glob("stage[0-9]_*")}))
    problems = []
    for ex in chosen:
        for target in ex.blank:  # the names exist (start would fail later, with a less helpful message)
            path, _, qualname = target.partition("::")
            _find(ast.parse((REPO / ex.stage / path).read_text()), qualname)
    all_tests = list(dict.fromkeys(t for ex in chosen for t in ex.tests))
    code, text = _pytest_in(REPO, all_tests, stages)
    if code != 0:
        problems.append(f"the exercises' tests do not all pass on the stages:\n{text[-3000:]}")
    with tempfile.TemporaryDirectory(prefix="exercises-") as tmp:
        for ex in chosen:
            dest = start(ex, Path(tmp) / ex.name)
            code, text = _pytest_in(dest, ex.tests, stages)
            if code == 0:
                problems.append(f"{ex.name}: its tests pass on the copy with {', '.join(ex.blank)} removed")
            elif "NotImplementedError" not in text:
                problems.append(f"{ex.name}: its tests fail on the fresh copy, but not at the removed code:\n"
                                f"{text[-3000:]}")
    return problems


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tools/exercises.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="every exercise")
    p_list.add_argument("--stage", help="only this stage's (e.g. stage2_scheduled)")
    for name, helptext in (("start", "copy the stage with the exercise's bodies removed"),
                           ("check", "run the exercise's tests on the scratch copy"),
                           ("show", "what to write, the hint, the tests")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("name")
        if name != "show":
            p.add_argument("--dir", type=Path, help="the scratch folder (default: scratch/NAME)")
        if name == "start":
            p.add_argument("--force", action="store_true", help="replace an existing scratch copy")
    p_verify = sub.add_parser("verify", help="CI: each exercise's tests pass on the stage and fail on its fresh copy")
    p_verify.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    try:
        if args.command == "verify":
            problems = verify(args.names)
            print("\n\n".join(problems) if problems else f"ok: {len(args.names) or len(load())} exercises")
            return 1 if problems else 0
        if args.command == "list":
            for ex in load().values():
                if args.stage in (None, ex.stage):
                    print(f"{ex.name:<22} {ex.stage:<18} {', '.join(t.split('::')[-1] for t in ex.blank)}")
            return 0
        ex = get(args.name)
        if args.command == "show":
            print(ex.describe())
            return 0
        if args.command == "start":
            dest = start(ex, args.dir, args.force)
            print(f"{dest}: {ex.stage} with the exercise's function bodies removed\n\n{ex.describe()}\n\n"
                  f"Edit the files under {dest / ex.stage}, then: python tools/exercises.py check {ex.name}"
                  + (f" --dir {args.dir}" if args.dir else ""))
            return 0
        result = check(ex, args.dir)
        verdict = "passed — well done" if result.returncode == 0 else "not yet (see the failures above)"
        print(f"\n{ex.name}: {verdict}")
        return result.returncode
    except ExerciseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
