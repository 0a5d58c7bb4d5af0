"""Each stage's chapter: what its diff against the previous stage is made of, topic by topic.

The map is ``tools/chapters.toml``. Every change between stage N-1 and stage N belongs to a topic of stage N's
chapter; a change that belongs to none is drift (a fix made in one copy of a file and not in the other).

A topic claims changes with three kinds of selector (paths are relative to the stage folder, ``*`` matches across
folders):

* ``"kernel/*"`` — whole files: every change in them, unless a hunk selector claims that hunk (and an exact path
  wins over a wildcard). A wildcard selects only files new in this stage: a file the previous stage has is claimed
  by its exact path or, better, hunk by hunk, so that a fix made in one copy only cannot hide in it;
* ``"engine/engine.py::Engine._num_pages"`` — the hunks inside that class or function (or anything nested in it);
* ``'server/args.py~--tp|tp_split_problem'`` — the hunks of that file with a changed line matching the regex.

A hunk is one run of changed lines (no context); in a new file, each top-level statement and each member of a
class is one. Hunk selectors win over whole-file ones, so a file shared by several topics can name one topic as its
default owner and hand single hunks to others. ``"!selector"`` takes hunks out of its topic's claims: a broad regex
of one topic can leave a hunk to another. Every hunk belongs to exactly one topic (`drift` reports a hunk two
topics claim at the same rank, and a file two topics claim whole).
"""

from __future__ import annotations

import ast
import builtins
import difflib
import fnmatch
import keyword
import re
import subprocess
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

REPO = Path(__file__).resolve().parents[1]
MAP_NAME = "tools/chapters.toml"
TABLE_BEGIN, TABLE_END = "<!-- topics -->", "<!-- /topics -->"


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


# -- the map -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Claim:
    topic: str
    text: str
    glob: str
    symbol: str = ""
    pattern: str = ""
    exclude: bool = False  # "!selector": the topic's other selectors do not take these hunks

    @classmethod
    def parse(cls, topic: str, text: str) -> Claim:
        body, exclude = (text[1:], True) if text.startswith("!") else (text, False)
        sym_at, pat_at = body.find("::"), body.find("~")
        if pat_at >= 0 and (sym_at < 0 or pat_at < sym_at):
            glob, pattern = body[:pat_at], body[pat_at + 1 :]
            try:
                re.compile(pattern)
            except re.error as exc:
                raise StageError(f"{MAP_NAME}: topic {topic!r}: bad regex in {text!r}: {exc}") from exc
            return cls(topic, text, glob, pattern=pattern, exclude=exclude)
        if sym_at >= 0:
            return cls(topic, text, body[:sym_at], symbol=body[sym_at + 2 :], exclude=exclude)
        return cls(topic, text, body, exclude=exclude)

    @property
    def per_hunk(self) -> bool:
        return bool(self.symbol or self.pattern)

    @property
    def rank(self) -> str:
        return "hunk" if self.per_hunk else "wildcard" if any(ch in self.glob for ch in "*?[") else "exact"

    def covers_file(self, path: str) -> bool:
        return fnmatch.fnmatchcase(path, self.glob)

    def covers(self, hunk: Hunk) -> bool:
        if not self.covers_file(hunk.path):
            return False
        if self.symbol:
            return any(s == self.symbol or s.startswith(self.symbol + ".") for s in hunk.symbols)
        if self.pattern:
            return any(re.search(self.pattern, line) for line in hunk.changed)
        return hunk.new_file or self.rank == "exact"


@dataclass
class Topic:
    name: str
    about: str
    claims: List[Claim] = field(default_factory=list)


@dataclass
class Chapter:
    stage: int  # the later stage of the pair (stage - 1 -> stage)
    topics: Dict[str, Topic]

    def winning_claims(self, hunk: Hunk) -> List[Claim]:
        """The claims that decide a hunk's topic: its hunk selectors; else the selectors naming its file exactly; else
        the wildcards claiming it (so `attention/*` and `attention/hybrid_linear.py` can be two topics')."""
        topics = [t for t in self.topics.values() if not any(c.exclude and c.covers(hunk) for c in t.claims)]
        for rank in ("hunk", "exact", "wildcard"):
            found = [c for t in topics for c in t.claims if not c.exclude and c.rank == rank and c.covers(hunk)]
            if found:
                return found
        return []

    def owners(self, hunk: Hunk) -> List[str]:
        """The topics a hunk belongs to (see winning_claims): exactly one in a consistent map."""
        return list(dict.fromkeys(c.topic for c in self.winning_claims(hunk)))

    def topic(self, name: str) -> Topic:
        if name not in self.topics:
            raise StageError(f"stage {self.stage}'s chapter has no topic {name!r} (topics: {', '.join(self.topics)})")
        return self.topics[name]


def load_map(repo: Path = REPO) -> Dict[int, Chapter]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    data = tomllib.loads((repo / MAP_NAME).read_text())
    chapters = {}
    for key, topics in data.items():
        if not re.fullmatch(r"stage\d", key):
            raise StageError(f"{MAP_NAME}: table [{key}] should be named after a stage, e.g. [stage4.tp]")
        stage = int(key[5])
        chapter = Chapter(stage, {})
        for name, body in topics.items():
            unknown = set(body) - {"about", "claims"}
            if unknown:
                raise StageError(f"{MAP_NAME}: [{key}.{name}] has unknown key(s) {sorted(unknown)}")
            claims = [Claim.parse(name, text) for text in body.get("claims", [])]
            chapter.topics[name] = Topic(name, body.get("about", ""), claims)
        chapters[stage] = chapter
    return chapters


def chapter_for(repo: Path, a: int, b: int) -> Chapter:
    if b != a + 1:
        raise StageError(f"topics belong to one stage's chapter: compare adjacent stages, e.g. diff {b - 1} {b}")
    stage_dir(repo, a), stage_dir(repo, b)
    chapters = load_map(repo)
    if b not in chapters:
        raise StageError(f"stage {b} has no chapter in {MAP_NAME}")
    return chapters[b]


# -- drift ---------------------------------------------------------------------------------------------------------
# words that say nothing about a hunk's topic: a selector built on one would claim unrelated hunks later
_COMMON_WORDS = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | frozenset(typing.__all__) | {
    "self", "torch", "Tensor", "import", "return", "assert", "result", "results", "value", "values", "args", "kwargs",
    "none", "true", "false", "with", "from", "this", "that", "every", "each", "when", "then", "else", "only",
    "typing", "dataclass", "dataclasses", "field", "annotations", "__future__"}


def _escape(text: str) -> str:
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


def _suggest_claim(fd: FileDiff, hunk: Hunk) -> str:
    """A selector that claims this hunk, for the error message."""
    if fd.old is None:
        return f'"{fd.path}"'
    if hunk.new_symbols:
        return f'"{fd.path}::{min(hunk.new_symbols, key=len)}"'
    for lines, other in ((hunk.added, fd.old), (hunk.removed, fd.new or [])):
        words = [w for w in re.findall(r"--[a-z][a-z0-9-]+|[A-Za-z_][A-Za-z0-9_]{3,}", "".join(lines))
                 if w not in _COMMON_WORDS]
        other_text = "".join(other)
        fresh = [w for w in words if w not in other_text] or words
        if fresh:
            return f"'{fd.path}~{_escape(max(fresh, key=len))}'"
    first = next((line.strip() for line in hunk.changed if line.strip()), "")
    return f"'{fd.path}~{_escape(first)}'" if first else f'"{fd.path}"'


def _likely_topic(chapter: Chapter, path: str) -> str:
    """The topic that claims most of this file's hunks, else most of its folder's files."""
    folder = path.rsplit("/", 1)[0] if "/" in path else ""

    def score(topic: Topic) -> tuple:
        same_folder = sum((c.glob.rsplit("/", 1)[0] if "/" in c.glob else "") == folder for c in topic.claims)
        return sum(c.covers_file(path) for c in topic.claims), same_folder

    best = max(chapter.topics.values(), key=score, default=None)
    return best.name if best is not None and any(score(best)) else "TOPIC"


def suggest_claims(repo: Path, stage: int) -> List[str]:
    """Selectors that would claim every hunk of stage `stage`'s diff that no topic claims yet, one per new file or
    new function and one regex per file for the rest: what to paste under a topic after merging a feature branch
    (read them first: a fix made in one copy only belongs in both copies, not in the map)."""
    chapter = chapter_for(repo, stage - 1, stage)
    claims: List[str] = []
    words: Dict[str, List[str]] = {}
    for fd in pair_diff(repo, stage - 1, stage, include="drift"):
        for hunk in fd.hunks:
            if chapter.owners(hunk):
                continue
            claim = _suggest_claim(fd, hunk)
            if "~" in claim:
                pattern = claim.split("~", 1)[1].rstrip("'")
                words.setdefault(fd.path, [])
                if pattern not in words[fd.path]:
                    words[fd.path].append(pattern)
            elif claim not in claims:
                claims.append(claim)
    claims += [f"'{path}~{'|'.join(pats)}'" for path, pats in words.items()]
    return claims


def unclaimed_message(chapter: Chapter, prev: str, this: str, fd: FileDiff, hunk: Hunk) -> str:
    where = "a new file" if hunk.new_file else ", ".join(sorted(s for s in hunk.symbols if s)) or "module level"
    shown = [f"    -{line.rstrip()}" for line in hunk.removed[:3]]
    shown += [f"    +{line.rstrip()}" for line in hunk.added[:3]]
    more = len(hunk.changed) - len(shown)
    return "\n".join([
        f"{this}/{hunk.location()} ({where}): a change from {prev} that is in no topic of stage {chapter.stage}'s "
        "chapter",
        *shown, *(["    ..."] if more > 0 else []),
        f"  part of the chapter? add to a topic's claims in {MAP_NAME}, e.g. under [stage{chapter.stage}."
        f"{_likely_topic(chapter, fd.path)}]:",
        f"      {_suggest_claim(fd, hunk)},",
        f"  (after merging a feature: `python tools/stages.py drift --suggest {chapter.stage}` prints the lines for "
        "all of its hunks)",
        f"  a fix? make {prev}'s copy and {this}'s the same (and every later stage's copy: fix forward).",
    ])


def double_claim_message(chapter: Chapter, this: str, hunk: Hunk) -> str:
    """A hunk that two topics claim at the same rank: `diff --topic` would show it in both."""
    where = "a new file" if hunk.new_file else ", ".join(sorted(s for s in hunk.symbols if s)) or "module level"
    claims = chapter.winning_claims(hunk)
    by = "; ".join(f"[stage{chapter.stage}.{c.topic}] {c.text!r}" for c in claims)
    first = next((line.strip() for line in hunk.changed if line.strip()), "")
    return (f"{this}/{hunk.location()} ({where}): claimed by two topics of stage {chapter.stage}'s chapter: {by}\n"
            f"    {first[:100]}\n"
            f"  one topic only: narrow a selector in {MAP_NAME} (a hunk selector of one topic, or a regex that the "
            "other's hunk does not match)")


def double_file_claims(chapter: Chapter) -> List[str]:
    """Two topics naming one file exactly: which of them owns a hunk no hunk selector takes would be a coin toss."""
    named: Dict[str, List[str]] = {}
    for topic in chapter.topics.values():
        for claim in topic.claims:
            if claim.rank == "exact" and not claim.exclude and topic.name not in named.setdefault(claim.glob, []):
                named[claim.glob].append(topic.name)
    return [f"{MAP_NAME}: {path!r} is claimed as a whole file by two topics of stage {chapter.stage}'s chapter: "
            f"{', '.join(names)} (keep it in one; hand single hunks to the others with hunk selectors)"
            for path, names in named.items() if len(names) > 1]


def drift(repo: Path = REPO) -> List[str]:
    """Every change between adjacent stages must belong to exactly one topic of the later stage's chapter, and every
    selector of the map must still select something (a stale one would hide a future drift)."""
    chapters = load_map(repo)
    dirs = stage_dirs(repo)
    problems = [f"{MAP_NAME}: [stage{n}] names no stage folder" for n in chapters if n not in dirs]
    for b in sorted(dirs):
        if b - 1 not in dirs:
            continue
        if b not in chapters:
            problems.append(f"{dirs[b].name}: no chapter in {MAP_NAME} (add a [stage{b}.TOPIC] table)")
            continue
        chapter, prev, this = chapters[b], dirs[b - 1].name, dirs[b].name
        used = set()
        for fd in pair_diff(repo, b - 1, b, include="drift"):
            for hunk in fd.hunks:
                used |= {c for t in chapter.topics.values() for c in t.claims if c.covers(hunk) and
                         (not c.exclude or any(o.covers(hunk) for o in t.claims if not o.exclude))}
                owners = chapter.owners(hunk)
                if not owners:
                    problems.append(unclaimed_message(chapter, prev, this, fd, hunk))
                elif len(owners) > 1:
                    problems.append(double_claim_message(chapter, this, hunk))
        problems += double_file_claims(chapter)
        for topic in chapter.topics.values():
            for claim in topic.claims:
                if claim not in used:
                    problems.append(f"{MAP_NAME} [stage{b}.{topic.name}]: {claim.text!r} selects no change between "
                                    f"{prev} and {this} (stale: remove it or fix its path)")
    return problems


def iter_topic_hunks(diffs: List[FileDiff], chapter: Chapter, topic: str) -> Iterator[Tuple[FileDiff, List[bool]]]:
    """For each file with hunks of the topic: which of its hunks belong to it."""
    for fd in diffs:
        picked = [topic in chapter.owners(h) for h in fd.hunks]
        if any(picked):
            yield fd, picked


# -- README checks -----------------------------------------------------------------------------------------------
def topic_table(chapter: Chapter) -> str:
    """The chapter's topics as the markdown table between the README's topic markers."""
    b = chapter.stage
    rows = [
        TABLE_BEGIN,
        f"`python tools/stages.py diff {b - 1} {b} --topic NAME` shows one topic alone (`--all` adds its tests). "
        f"The map is `{MAP_NAME}`: whole files, or single hunks of files that several topics share.",
        "",
        "| topic | what it covers | files | hunks in |",
        "|---|---|---|---|",
    ]
    for t in chapter.topics.values():
        files = [c.glob for c in t.claims if not c.per_hunk and not c.exclude]
        shared = list(dict.fromkeys(c.glob for c in t.claims if c.per_hunk and not c.exclude))
        cell = lambda names: ", ".join(f"`{n}`" for n in names) or "–"  # noqa: E731
        rows.append(f"| `{t.name}` | {t.about.replace('|', '/') or '(to come)'} | {cell(files)} | {cell(shared)} |")
    rows.append(TABLE_END)
    return "\n".join(rows)


def topic_table_problems(repo: Path = REPO, write: bool = False) -> List[str]:
    """Each stage README with topic markers holds its chapter's current table (write=True refreshes it)."""
    problems = []
    chapters = load_map(repo)
    for n, directory in stage_dirs(repo).items():
        readme = directory / "README.md"
        text = readme.read_text() if readme.is_file() else ""
        if TABLE_BEGIN not in text:
            continue
        if n not in chapters:
            problems.append(f"{directory.name}/README.md has a topic table but stage {n} has no chapter in {MAP_NAME}")
            continue
        head, rest = text.split(TABLE_BEGIN, 1)
        if TABLE_END not in rest:
            problems.append(f"{directory.name}/README.md: {TABLE_BEGIN} without {TABLE_END}")
            continue
        tail = rest.split(TABLE_END, 1)[1]
        fresh = head + topic_table(chapters[n]) + tail
        if fresh != text:
            if write:
                readme.write_text(fresh)
            else:
                problems.append(f"{directory.name}/README.md: the topic table is not {MAP_NAME}'s "
                                "(run: python tools/stages.py topics --write)")
    return problems


_UNCHANGED = re.compile(r"Unchanged from stage(\d)\b[^:]*:", re.IGNORECASE)


def unchanged_claims(text: str) -> Iterator[Tuple[int, List[str]]]:
    """("Unchanged from stageN ...: `a.py`, `dir/`, stageN's tests.") -> (N, ["a.py", "dir/", "tests/"]); the list
    ends at the first full stop outside backticks."""
    for match in _UNCHANGED.finditer(text):
        rest, in_code, end = text[match.end():], False, None
        for i, ch in enumerate(rest):
            in_code ^= ch == "`"
            if ch == "." and not in_code and (i + 1 == len(rest) or rest[i + 1].isspace()):
                end = i
                break
        items = rest[:end]
        paths = re.findall(r"`([^`]+)`", items)
        if re.search(r"stage\d\w*'s tests", items):
            paths.append("tests/")
        yield int(match.group(1)), paths


def unchanged_claim_problems(repo: Path = REPO) -> List[str]:
    """What a README says is unchanged from the previous stage is byte for byte the same (package name aside)."""
    problems = []
    dirs = stage_dirs(repo)
    for n, directory in dirs.items():
        readme = directory / "README.md"
        if not readme.is_file():
            continue
        for prev, paths in unchanged_claims(readme.read_text()):
            where = f"{directory.name}/README.md"
            if prev != n - 1 or prev not in dirs:
                problems.append(f"{where}: 'Unchanged from stage{prev}' should compare with stage{n - 1}")
                continue
            da = dirs[prev]
            old_files, new_files = set(stage_files(da)), set(stage_files(directory))
            for path in paths:
                is_dir = path.endswith("/") or (da / path).is_dir()
                prefix = path.rstrip("/") + "/"
                olds = sorted(f for f in old_files if f.startswith(prefix)) if is_dir else [path]
                if not olds or not all(f in old_files for f in olds):
                    problems.append(f"{where}: says `{path}` is unchanged from {da.name}, which has no such path")
                    continue
                added = sorted(f for f in new_files if f.startswith(prefix) and f not in old_files and
                               not f.startswith("tests/")) if is_dir else []
                changed = [f for f in olds if f not in new_files or
                           _read_lines(da / f, (da.name, directory.name)) != _read_lines(directory / f)]
                if changed or added:
                    problems.append(f"{where}: says `{path}` is unchanged from {da.name}, but "
                                    + ", ".join([f"{f} differs" for f in changed] + [f"{f} is new" for f in added]))
    return problems
