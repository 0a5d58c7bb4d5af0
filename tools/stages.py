"""Stage hygiene, and the stages read as chapters.

    python tools/stages.py check                  # each stage imports only itself and third-party packages
    python tools/stages.py diff N M               # what stage M changes relative to stage N: a summary, then the diff
    python tools/stages.py diff 3 4 --topic tp    # one topic of stage 4's chapter alone (topics: tools/chapters.toml)
    python tools/stages.py diff N M --stat        # the summary only; --all adds tests and READMEs
    python tools/stages.py topics [N]             # the chapters' topics; --write refreshes the READMEs' tables
    python tools/stages.py chapters               # every topic of every stage in reading order, with its size
    python tools/stages.py drift                  # every change between adjacent stages: in exactly one topic
    python tools/stages.py drift --suggest 4      # selectors for stage 4's unclaimed hunks (after a merge)

Package names are normalised: stage N's name reads as stage M's.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from collections import defaultdict
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chapters  # noqa: E402  (tools/ is not a package)
from chapters import Chapter, FileDiff, StageError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOCAL_TOP_LEVEL = {"models", "bench", "tools", "shared_tests", "conftest", "noxfile"}


def stage_dirs() -> list[Path]:
    return sorted(p for p in REPO.glob("stage[0-9]_*") if (p / "__init__.py").exists())


def imported_roots(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def check() -> list[str]:
    stages = {p.name for p in stage_dirs()} | {p.name for p in REPO.glob("stage[0-9]_*")}
    problems = []
    for stage in stage_dirs():
        for f in sorted(stage.rglob("*.py")):
            for line, root in imported_roots(f):
                if root != stage.name and (root in stages or root in LOCAL_TOP_LEVEL):
                    problems.append(f"{f.relative_to(REPO)}:{line}: imports {root!r} (a stage may import only itself)")
    return problems


# -- diff ------------------------------------------------------------------------------------------------------------
def _file_patch(fd: FileDiff, a_name: str, b_name: str, label: str = "") -> str:
    """A unified diff of the file's hunks (fd.hunks may be a subset: then the previous stage's file with only those
    applied is compared, which shows them with context and nothing else)."""
    old, new = fd.old or [], fd.new or []
    if fd.status == "A" and sum(len(h.added) for h in fd.hunks) < len(new):  # some definitions of a new file
        spans: List[List[int]] = []
        for hunk in fd.hunks:  # adjacent definitions read as one block
            if spans and spans[-1][1] == hunk.new_span[0]:
                spans[-1][1] = hunk.new_span[1]
            else:
                spans.append(list(hunk.new_span))
        out = [f"--- /dev/null\n+++ {b_name}/{fd.path}{label}\n"]
        for j1, j2 in spans:
            out += [f"@@ -0,0 +{j1 + 1},{j2 - j1} @@\n"] + [f"+{line}" for line in new[j1:j2]]
        text = "".join(out)
        return text if text.endswith("\n") else text + "\n\\ No newline at end of file\n"
    if fd.status == "M":
        out, pos = [], 0
        for hunk in fd.hunks:
            (i1, i2), (j1, j2) = hunk.old_span, hunk.new_span
            out += old[pos:i1] + new[j1:j2]
            pos = i2
        new = out + old[pos:]
    a_label = f"{a_name}/{fd.path}" if fd.old is not None else "/dev/null"
    b_label = f"{b_name}/{fd.path}{label}" if fd.new is not None else "/dev/null"
    text = "".join(difflib.unified_diff(old, new, a_label, b_label))
    return text if text.endswith("\n") or not text else text + "\n\\ No newline at end of file\n"


def _summary(diffs: List[FileDiff], a_name: str, b_name: str, include: str, chapter: Chapter | None,
             topic: str | None) -> str:
    added = sum(fd.counts[0] for fd in diffs)
    removed = sum(fd.counts[1] for fd in diffs)
    scope = "tests and READMEs left out (--all shows them)" if include == "code" else "tests and READMEs included"
    what = f"topic {topic!r}: " if topic else ""
    lines = [f"{a_name} -> {b_name}: {what}{len(diffs)} files differ, +{added} -{removed} lines; {scope}"]
    if chapter is not None and topic is None:
        lines.append(f"  {'topic':<16} {'files':>5} {'+lines':>7} {'-lines':>7}  (diff ... --topic NAME)")
        for t in chapter.topics.values():
            files, plus, minus = set(), 0, 0
            for fd in diffs:
                for hunk in fd.hunks:
                    if t.name in chapter.owners(hunk):
                        files.add(fd.path)
                        plus, minus = plus + len(hunk.added), minus + len(hunk.removed)
            about = t.about if len(t.about) <= 70 else t.about[:69] + "…"
            lines.append(f"  {t.name:<16} {len(files):>5} {plus:>7} {minus:>7}  {about}")
    by_dir: dict[str, list[FileDiff]] = defaultdict(list)
    for fd in diffs:
        by_dir[fd.path.rsplit("/", 1)[0] + "/" if "/" in fd.path else "./"].append(fd)
    lines.append(f"  {'folder':<18} {'+lines':>7} {'-lines':>7}  files (A new, D gone, M changed)")
    for folder, fds in by_dir.items():
        plus, minus = sum(fd.counts[0] for fd in fds), sum(fd.counts[1] for fd in fds)
        names = " ".join(f"{fd.status}:{fd.path.rsplit('/', 1)[-1]}" for fd in fds)
        names = names if len(names) <= 80 else names[:79] + "…"
        lines.append(f"  {folder:<18} {plus:>7} {minus:>7}  {names}")
    return "\n".join(lines) + "\n"


def diff(a: int, b: int, topic: str | None = None, include: str = "code", stat: bool = False) -> str:
    """The summary, then the unified diff (of one topic of b's chapter when topic is given)."""
    da, db = chapters.stage_dir(REPO, a), chapters.stage_dir(REPO, b)
    chapter = chapters.chapter_for(REPO, a, b) if topic or b == a + 1 else None
    if topic:
        chapter.topic(topic)
    diffs = chapters.pair_diff(REPO, a, b, include)
    if topic:
        chosen = list(chapters.iter_topic_hunks(diffs, chapter, topic))
        for fd, picked in chosen:
            fd.hunks = [h for h, take in zip(fd.hunks, picked) if take]
        diffs = [fd for fd, _ in chosen]
    out = [_summary(diffs, da.name, db.name, include, chapter, topic)]
    if not stat:
        label = f" ({topic} only)" if topic else ""
        out += ["\n"] + [_file_patch(fd, da.name, db.name, label) for fd in diffs]
    return "".join(out)


def topics(stage: int | None) -> str:
    chs = chapters.load_map(REPO)
    if stage is not None:
        chapters.stage_dir(REPO, stage)
        if stage not in chs:
            raise StageError(f"stage {stage} has no chapter in {chapters.MAP_NAME}")
    out = []
    for n, chapter in sorted(chs.items()):
        if stage is None or n == stage:
            out.append(f"stage {n} (diff {n - 1} {n} --topic NAME):")
            out += [f"  {t.name:<16} {t.about}" for t in chapter.topics.values()]
    return "\n".join(out) + "\n"


def topic_sizes(a: int, b: int, chapter: Chapter) -> dict[str, tuple[int, int, int]]:
    """Each topic of stage b's chapter: (files, +lines, -lines) of its hunks, tests and READMEs left out."""
    sizes = {name: (set(), 0, 0) for name in chapter.topics}
    for fd in chapters.pair_diff(REPO, a, b, "code"):
        for hunk in fd.hunks:
            for name in chapter.owners(hunk):
                files, plus, minus = sizes[name]
                files.add(fd.path)
                sizes[name] = (files, plus + len(hunk.added), minus + len(hunk.removed))
    return {name: (len(files), plus, minus) for name, (files, plus, minus) in sizes.items()}


def chapter_list() -> str:
    """Every topic of every stage in reading order (stage by stage, topics in the map's order), with its size."""
    out = [f"{'stage':<6} {'topic':<18} {'files':>5} {'+lines':>7} {'-lines':>7}  (tests left out; "
           "diff N-1 N --topic NAME)"]
    dirs = chapters.stage_dirs(REPO)
    for n, chapter in sorted(chapters.load_map(REPO).items()):
        if n not in dirs or n - 1 not in dirs:
            continue
        for name, (files, plus, minus) in topic_sizes(n - 1, n, chapter).items():
            about = chapter.topics[name].about
            about = about if len(about) <= 60 else about[:59] + "…"
            out.append(f"{n:<6} {name:<18} {files:>5} {plus:>7} {minus:>7}  {about}")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tools/stages.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="each stage imports only itself and third-party packages")
    p_diff = sub.add_parser("diff", help="what stage M changes relative to stage N")
    p_diff.add_argument("a", type=int, metavar="N")
    p_diff.add_argument("b", type=int, metavar="M")
    p_diff.add_argument("--topic", help="one topic of stage M's chapter (M = N + 1)")
    p_diff.add_argument("--all", action="store_true", help="include tests and READMEs")
    p_diff.add_argument("--stat", action="store_true", help="the summary only")
    p_topics = sub.add_parser("topics", help="the chapters' topics")
    p_topics.add_argument("stage", type=int, nargs="?")
    p_topics.add_argument("--write", action="store_true", help="refresh the topic tables in the stage READMEs")
    sub.add_parser("chapters", help="every topic of every stage in reading order, with its size")
    p_drift = sub.add_parser("drift", help="every change between adjacent stages belongs to the later stage's chapter")
    p_drift.add_argument("--suggest", type=int, metavar="N",
                         help="print selectors that would claim stage N's unclaimed hunks (to paste under a topic)")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            problems = check()
            print("\n".join(problems) or f"ok: {len(stage_dirs())} stages import only themselves")
            return 1 if problems else 0
        if args.command == "diff":
            text = diff(args.a, args.b, args.topic, "all" if args.all else "code", args.stat)
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except BrokenPipeError:  # `| head`
                sys.stdout = None
            return 0
        if args.command == "topics":
            if args.write:
                chapters.topic_table_problems(REPO, write=True)
            sys.stdout.write(topics(args.stage))
            return 0
        if args.command == "chapters":
            sys.stdout.write(chapter_list())
            return 0
        if args.suggest is not None:
            lines = chapters.suggest_claims(REPO, args.suggest)
            print(f"# {len(lines)} selector(s) for the unclaimed hunks of stage {args.suggest}: paste them into a "
                  f"topic's claims in {chapters.MAP_NAME}\n# after reading them (a fix made in one copy only belongs "
                  "in every copy, not in the map)")
            print("\n".join(f"    {line}," for line in lines))
            return 0
        problems = (chapters.drift(REPO) + chapters.unchanged_claim_problems(REPO)
                    + chapters.topic_table_problems(REPO))
        print("\n\n".join(problems) if problems else "ok: every change between adjacent stages is in its chapter")
        return 1 if problems else 0
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
