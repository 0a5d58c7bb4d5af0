"""The diff between two stages as hunks: the unit that tools/chapters.toml assigns to topics.

A hunk is one run of changed lines (no context), split into whole statements for Python: a compound statement the
change cuts through gives its header and its body's statements, a docstring gives its paragraphs, and a new file
gives each top-level statement and each member of a class. Stage N's package name reads as stage M's.
"""

from __future__ import annotations

import ast
import difflib
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple


class StageError(Exception):
    """A stage, topic or map entry that does not exist; the message is for the user as is."""


# -- stages and their files ------------------------------------------------------------------------------------
def stage_dirs(repo: Path) -> Dict[int, Path]:
    return {int(p.name[5]): p for p in sorted(repo.glob("stage[0-9]_*")) if (p / "__init__.py").exists()}


def stage_dir(repo: Path, n: int) -> Path:
    dirs = stage_dirs(repo)
    if n not in dirs:
        raise StageError(f"no stage {n} (the stages are {', '.join(map(str, dirs))})")
    return dirs[n]


def stage_files(directory: Path) -> List[str]:
    """The stage's files relative to it: what git tracks or would track (build outputs and caches are ignored)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "."],
            cwd=directory, capture_output=True, text=True, check=True,
        ).stdout
        names = [n for n in out.split("\0") if n and (directory / n).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (a tarball, a test's tmp_path)
        names = [p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()]
    return sorted(n for n in names if "__pycache__" not in n.split("/"))


def is_test_or_readme(path: str) -> bool:
    return path.startswith("tests/") or path.endswith("README.md")


def _read_lines(path: Path, rename: Tuple[str, str] | None = None) -> List[str]:
    """The file's lines; with rename=(a, b) the package name a reads as b, except in a path to a's README (a
    document the copies all point to, e.g. the stage that describes the upstream defects)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if rename:
        old, new = rename
        keep = "\0readme\0"
        text = text.replace(f"{old}/README", keep).replace(old, new).replace(keep, f"{old}/README")
    return text.splitlines(keepends=True)


# -- hunks -------------------------------------------------------------------------------------------------------
def line_owners(lines: List[str]) -> List[str]:
    """For each line, the qualified name of the innermost class or function around it ("" at module level)."""
    owners = [""] * len(lines)
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return owners

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}" if prefix else child.name
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                for i in range(start - 1, child.end_lineno or start):
                    owners[i] = name
                visit(child, name)
            else:
                visit(child, prefix)

    visit(tree, "")
    return owners


@dataclass
class Hunk:
    path: str
    old_span: Tuple[int, int]  # [start, end) lines of the previous stage's file (package name replaced)
    new_span: Tuple[int, int]  # [start, end) lines of this stage's file
    removed: List[str]
    added: List[str]
    symbols: frozenset  # owners of its changed lines ("" = module level), see line_owners
    new_symbols: frozenset  # the subset that does not exist in the previous stage's file
    new_file: bool = False  # the file does not exist in the previous stage

    @property
    def changed(self) -> List[str]:
        return self.removed + self.added

    def location(self) -> str:
        (i1, i2), (j1, j2) = self.old_span, self.new_span
        if j2 > j1:
            return f"{self.path}:{j1 + 1}" + (f"-{j2}" if j2 - j1 > 1 else "")
        return f"{self.path} (after line {j1}: {i2 - i1} line(s) removed)"


@dataclass
class FileDiff:
    path: str
    old: List[str] | None  # None: the file is new in this stage
    new: List[str] | None  # None: the file is gone in this stage
    hunks: List[Hunk]

    @property
    def status(self) -> str:
        return "A" if self.old is None else "D" if self.new is None else "M"

    @property
    def counts(self) -> Tuple[int, int]:
        return sum(len(h.added) for h in self.hunks), sum(len(h.removed) for h in self.hunks)


def _parse(lines: List[str]) -> ast.Module | None:
    try:
        return ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None


def _start(node: ast.AST) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1


def statement_runs(tree: ast.Module | None, lo: int, hi: int, lines: List[str] | None = None
                   ) -> List[Tuple[int, int]]:
    """Split the changed lines [lo, hi) into runs of whole statements: each statement that lies inside them is one
    run (a new function is one run, two flags added side by side are two); a compound statement they cut through
    gives its header and, recursively, its body's statements; with the file's lines, a docstring they cut through
    gives its paragraphs (two topics' paragraphs added to a module's docstring). Lines in no statement (comments,
    blank lines, `else:`) join the run after them."""
    if tree is None or hi - lo <= 1:
        return [(lo, hi)] if hi > lo else []
    spans: List[Tuple[int, int]] = []

    def visit(body: list) -> None:
        for node in body:
            s, e = _start(node), node.end_lineno or node.lineno
            if e <= lo or s >= hi:
                continue
            bodies = [b for f in ("body", "orelse", "finalbody", "handlers")
                      if isinstance(b := getattr(node, f, None), list) and b and hasattr(b[0], "lineno")]
            if lines is not None and not (lo <= s and e <= hi) and _is_docstring(node):
                spans.extend(_paragraphs(lines, max(s, lo), min(e, hi)))
                continue
            if (lo <= s and e <= hi) or not bodies:
                spans.append((max(s, lo), min(e, hi)))
                continue
            first = min(_start(b[0]) for b in bodies)
            if max(s, lo) < min(first, hi):
                spans.append((max(s, lo), min(first, hi)))
            for b in bodies:
                visit(b)

    visit(tree.body)
    return _join(spans, lo, hi)


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _paragraphs(lines: List[str], lo: int, hi: int) -> List[Tuple[int, int]]:
    """Lines [lo, hi) of a string as paragraphs: a blank line starts the next one."""
    starts = [lo] + [i for i in range(lo + 1, hi) if not lines[i].strip() and lines[i - 1].strip()]
    return [(a, b) for a, b in zip(starts, starts[1:] + [hi])]


def _join(spans: List[Tuple[int, int]], lo: int, hi: int) -> List[Tuple[int, int]]:
    """Statement spans -> runs that cover [lo, hi): lines between statements join the run after them."""
    runs, begin = [], lo
    for _, e in sorted(spans):
        if e > begin:
            runs.append((begin, e))
            begin = e
    if begin < hi:
        runs = runs[:-1] + [(runs[-1][0], hi)] if runs else [(begin, hi)]
    return runs


def definition_runs(tree: ast.Module | None, n: int) -> List[Tuple[int, int]]:
    """A new file's n lines as runs: each top-level statement, a class as its header and each statement of its body
    (so `core.py::Req` and `scheduler/scheduler.py::Scheduler.overlap_loop` can be two topics' parts of one new
    file); comments and blank lines join the run after them."""
    if tree is None or n <= 1:
        return [(0, n)] if n else []
    spans: List[Tuple[int, int]] = []
    for node in tree.body:
        s, e = _start(node), node.end_lineno or node.lineno
        if isinstance(node, ast.ClassDef) and node.body:
            spans.append((s, _start(node.body[0])))
            spans += [(_start(b), b.end_lineno or b.lineno) for b in node.body]
        else:
            spans.append((s, e))
    return _join([(a, b) for a, b in spans if b > a], 0, n)


def _pair(old: List[str], new: List[str], old_runs: list, new_runs: list) -> List[Tuple[tuple | None, tuple | None]]:
    """Old and new runs of one changed block, the most similar pairs matched (a statement that was edited), like
    difflib.Differ's fancy replace; the rest stand alone (a statement added or removed)."""
    if not old_runs or not new_runs:
        return [(r, None) for r in old_runs] + [(None, r) for r in new_runs]
    best, at = 0.5, None
    for i, (a1, a2) in enumerate(old_runs):
        for j, (b1, b2) in enumerate(new_runs):
            matcher = difflib.SequenceMatcher(None, "".join(old[a1:a2]), "".join(new[b1:b2]), autojunk=False)
            if matcher.real_quick_ratio() > best and matcher.quick_ratio() > best and matcher.ratio() > best:
                best, at = matcher.ratio(), (i, j)
    if at is None:
        return [(r, None) for r in old_runs] + [(None, r) for r in new_runs]
    i, j = at
    return (_pair(old, new, old_runs[:i], new_runs[:j]) + [(old_runs[i], new_runs[j])]
            + _pair(old, new, old_runs[i + 1 :], new_runs[j + 1 :]))


def _slide(opcodes: list, old: List[str], new: List[str], old_tree: ast.Module | None,
           new_tree: ast.Module | None) -> List[Tuple[int, int, int, int]]:
    """The changed blocks (i1, i2, j1, j2). A block of added (or removed) lines can often sit a few lines higher or
    lower with the same result — `@property` / `def a` / ... / `@property` — and the matcher's choice may cut a
    statement in two; like git's indent heuristic, each such block moves to where it is the fewest whole statements
    (and, on a tie, ends with a blank line rather than starting with one)."""
    blocks = [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in opcodes if tag != "equal"]
    out: List[Tuple[int, int, int, int]] = []
    for k, (i1, i2, j1, j2) in enumerate(blocks):
        if (i1 == i2) == (j1 == j2):  # a replacement (or nothing): stays
            out.append((i1, i2, j1, j2))
            continue
        lines, tree, lo, hi = (new, new_tree, j1, j2) if i1 == i2 else (old, old_tree, i1, i2)
        side = 2 if i1 == i2 else 0  # which pair of the tuple holds the block's lines
        floor = out[-1][side + 1] if out else 0  # the previous block's end on that side
        ceiling = blocks[k + 1][side] if k + 1 < len(blocks) else len(lines)
        candidates = [0]
        d = 1
        while lo - d >= floor and lines[lo - d] == lines[hi - d]:
            candidates.append(-d)
            d += 1
        d = 0
        while hi + d < ceiling and lines[lo + d] == lines[hi + d]:
            d += 1
            candidates.append(d)

        scores = {shift: (len(statement_runs(tree, lo + shift, hi + shift)), bool(lines[hi + shift - 1].strip()),
                          not lines[lo + shift].strip(), abs(shift)) for shift in candidates}
        best = min(candidates, key=scores.__getitem__)
        out.append((i1 + best, i2 + best, j1 + best, j2 + best))
    return out


def _hunks(path: str, old: List[str], new: List[str], whole_file: bool) -> List[Hunk]:
    """The file's changes as hunks: runs of changed lines, split into statements for Python (see statement_runs), so
    that a change next to a chapter's change is still a hunk of its own."""
    is_py = path.endswith(".py")
    old_owners = line_owners(old) if is_py else [""] * len(old)
    new_owners = line_owners(new) if is_py else [""] * len(new)
    old_tree = _parse(old) if is_py and not whole_file else None
    new_tree = _parse(new) if is_py and not whole_file else None
    known = set(old_owners)
    hunks = []
    if whole_file and not old and new:  # a new file: its definitions are hunks of their own
        for b1, b2 in definition_runs(_parse(new) if is_py else None, len(new)):
            symbols = {new_owners[j] for j in range(b1, b2) if new[j].strip()} or {""}
            hunks.append(Hunk(path, (0, 0), (b1, b2), [], new[b1:b2], frozenset(symbols),
                              frozenset(s for s in symbols if s), new_file=True))
        return hunks
    for i1, i2, j1, j2 in _slide(difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes(), old, new,
                                 old_tree, new_tree):
        at_old, at_new = i1, j1
        pairs = _pair(old, new, statement_runs(old_tree, i1, i2, old), statement_runs(new_tree, j1, j2, new))
        for old_run, new_run in pairs:
            (a1, a2), (b1, b2) = old_run or (at_old, at_old), new_run or (at_new, at_new)
            at_old, at_new = a2, b2
            symbols = {old_owners[i] for i in range(a1, a2) if old[i].strip()}
            symbols |= {new_owners[j] for j in range(b1, b2) if new[j].strip()}
            symbols = symbols or {""}
            new_symbols = {s for s in symbols if s and s not in known}
            hunks.append(Hunk(path, (a1, a2), (b1, b2), old[a1:a2], new[b1:b2], frozenset(symbols),
                              frozenset(new_symbols), new_file=whole_file and not old))
    return hunks


def pair_diff(repo: Path, a: int, b: int, include: str = "code") -> List[FileDiff]:
    """Files that differ from stage a to stage b (a's package name read as b's). include: "code" leaves out tests
    and READMEs, "all" keeps them, "drift" keeps tests and leaves out READMEs (a README is its chapter's text)."""
    da, db = stage_dir(repo, a), stage_dir(repo, b)
    names = sorted(set(stage_files(da)) | set(stage_files(db)))
    if include == "code":
        names = [n for n in names if not is_test_or_readme(n)]
    elif include == "drift":
        names = [n for n in names if not n.endswith("README.md")]
    diffs = []
    for name in names:
        fa, fb = da / name, db / name
        old = _read_lines(fa, (da.name, db.name)) if fa.is_file() else None
        new = _read_lines(fb) if fb.is_file() else None
        if old == new:
            continue
        diffs.append(FileDiff(name, old, new, _hunks(name, old or [], new or [], old is None or new is None)))
    return diffs
