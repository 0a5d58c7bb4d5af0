"""Stage hygiene.

    python tools/stages.py check      # each stage imports only itself and third-party packages
    python tools/stages.py diff N M   # what stage M changes relative to stage N (package names normalised)
"""

from __future__ import annotations

import ast
import difflib
import sys
from pathlib import Path

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


def diff(a: int, b: int) -> str:
    (da,), (db,) = [[p for p in REPO.glob(f"stage{i}_*")] for i in (a, b)]
    out = []
    files = sorted({p.relative_to(da) for p in da.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
                   | {p.relative_to(db) for p in db.rglob("*") if p.is_file() and "__pycache__" not in p.parts})
    for rel in files:
        fa, fb = da / rel, db / rel
        ta = fa.read_text().replace(da.name, db.name).splitlines(keepends=True) if fa.exists() else []
        tb = fb.read_text().splitlines(keepends=True) if fb.exists() else []
        if ta != tb:
            out += difflib.unified_diff(ta, tb, f"{da.name}/{rel}", f"{db.name}/{rel}")
    return "".join(out)


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        problems = check()
        print("\n".join(problems) or f"ok: {len(stage_dirs())} stages import only themselves")
        return 1 if problems else 0
    if argv[:1] == ["diff"] and len(argv) == 3:
        sys.stdout.write(diff(int(argv[1]), int(argv[2])))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
