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

A hunk is one run of changed lines (no context; tools/stage_diff.py): in a new file, each top-level statement and
each member of a class is one. Hunk selectors win over whole-file ones, so a file shared by several topics can name
one topic as its default owner and hand single hunks to others. ``"!selector"`` takes hunks out of its topic's
claims: a broad regex of one topic can leave a hunk to another. Every hunk belongs to exactly one topic (`drift`
reports a hunk two topics claim at the same rank, and a file two topics claim whole).
"""

from __future__ import annotations

import builtins
import fnmatch
import keyword
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_diff import (  # noqa: E402, F401  (tools/ is not a package; chapters.X reads as before)
    FileDiff,
    Hunk,
    StageError,
    _hunks,
    _read_lines,
    definition_runs,
    is_test_or_readme,
    line_owners,
    pair_diff,
    stage_dir,
    stage_dirs,
    stage_files,
    statement_runs,
)

REPO = Path(__file__).resolve().parents[1]
MAP_NAME = "tools/chapters.toml"
TABLE_BEGIN, TABLE_END = "<!-- topics -->", "<!-- /topics -->"


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
def topic_table(chapter: Chapter, diffs: List[FileDiff]) -> str:
    """The chapter's topics as the markdown table between the README's topic markers: each topic's lines added and
    removed in the code (tests and READMEs left out, as `diff --stat` counts them); its files are in that summary."""
    b = chapter.stage
    rows = [
        TABLE_BEGIN,
        f"`python tools/stages.py diff {b - 1} {b} --topic NAME` shows one topic alone (`--all` adds its tests; "
        f"`--stat` lists its files). The map is `{MAP_NAME}`: whole files, or single hunks of files that several "
        "topics share. Lines: the topic's code, tests left out.",
        "",
        "| topic | what it covers | +/- lines |",
        "|---|---|--:|",
    ]
    for t in chapter.topics.values():
        plus = minus = 0
        for fd in diffs:
            for hunk in fd.hunks:
                if t.name in chapter.owners(hunk):
                    plus, minus = plus + len(hunk.added), minus + len(hunk.removed)
        rows.append(f"| `{t.name}` | {t.about.replace('|', '/') or '(to come)'} | +{plus} -{minus} |")
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
        fresh = head + topic_table(chapters[n], pair_diff(repo, n - 1, n)) + tail
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
