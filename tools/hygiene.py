"""The repository speaks of the project only: no tracked file names the tools, work items or documents behind its
development, which a reader does not have. Part of `nox -s lint`.

    python tools/hygiene.py            # exit 1 and list file:line: text for every finding

What it looks for (RULES): issue and work-item numbers, sections of notes that are not in the repository, absolute
paths of the machine the work was done on, the harness words of remote GPU runs (output-folder variables, carried
paths, call budgets, "session" as a unit of work), and names of documents outside the repository. Cite the
upstream file and line, or a README section, instead. Binary files are skipped; so are this file and its test,
which must spell the words out.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXEMPT = {"tools/hygiene.py", "tools/tests/test_hygiene.py"}


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern


def _rule(name: str, pattern: str, flags: int = re.IGNORECASE) -> Rule:
    return Rule(name, re.compile(pattern, flags))


RULES = [
    _rule("work item number", r"\b(?:issue|ticket|task)[ #-]*\d+\b"),
    _rule("work item", r"\bstage\d issue\b|\bthe issue (?:does|asks|says|wants)\b"),
    _rule("notes the reader lacks", r"\binterfaces map\b|§\s*\d"),
    _rule("document outside the repository", r"\b(?:GPU_NOTES|UPSTREAM_INTERFACES|STYLE|BRIEF)\.md\b|\.\./shared/", 0),
    _rule("path of the development machine", r"(?<![\w.~-])/work/"),
    _rule("remote-run output variable", r"\$OUT\b", 0),
    _rule("remote-run harness", r"\bcarry\s*=|\bcarried wheels\b|\bcarry limit\b|\btwo-call carry\b"
                                r"|\bdevice (?:call|tool|budget)s?\b|\bdevice time (?:left|used)\b"
                                r"|\bbudget_left|\bCALL_BUDGET\b|\bthe machine's rules?\b|\blendable\b"),
    _rule("remote-run machine kind", r"\bnvidia-h\d+(?:-x\d+)?\b", 0),
    _rule("session as a unit of work", r"\b(?:first|second|third|previous|earlier|later|next|this) session\b"
                                       r"|\bsession's (?:\d+|budget|minutes)"),
    _rule("folder that is not in the repository", r"(?<![\w.-])wip/"),
]


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.text.strip()[:160]}"


def scan_text(path: str, text: str) -> list[Finding]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        out += [Finding(path, number, r.name, line) for r in RULES if r.pattern.search(line)]
    return out


def tracked_files(root: Path) -> list[str]:
    return subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.split("\0")


def scan(root: Path = REPO) -> list[Finding]:
    findings = []
    for rel in tracked_files(root):
        if not rel or rel in EXEMPT or not (root / rel).is_file():
            continue
        data = (root / rel).read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (plots)
        findings += scan_text(rel, data.decode("utf-8", errors="replace"))
    return findings


def main() -> int:
    findings = scan()
    for f in findings:
        print(f)
    print(f"hygiene: {len(findings)} finding(s)" if findings else "hygiene: clean")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
