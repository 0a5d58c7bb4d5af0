"""GAP.md (what SGLang has that stage4 lacks): every code path it names exists, its anchors resolve, and it stays
short enough to read in one sitting."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GAP = REPO / "GAP.md"
MAX_BYTES = 20_000
# a backticked file or folder: `scheduler/prefill.py`, `attention/`, `stage4_fast/README.md`
PATH_TOKEN = re.compile(r"`([A-Za-z_][\w./-]*(?:\.py|\.md|/))`")
# paths are relative to stage4_fast/ unless they start at the repository root
ROOT_DIRS = ("stage4_fast/", "bench/", "tools/", "models/random_models.py")


def _resolve(token: str) -> Path:
    return REPO / token if token.startswith(ROOT_DIRS) else REPO / "stage4_fast" / token


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_named_paths_exist():
    tokens = sorted(set(PATH_TOKEN.findall(GAP.read_text())))
    assert len(tokens) > 20  # the check itself still finds the paths
    missing = [t for t in tokens if not _resolve(t).exists()]
    assert missing == [], f"GAP.md names paths that do not exist: {missing}"


def test_summary_links_reach_sections():
    text = GAP.read_text()
    anchors = {_slug(h) for h in re.findall(r"^## (.+)$", text, flags=re.MULTILINE)}
    links = set(re.findall(r"\]\(#([\w-]+)\)", text))
    assert links and links <= anchors, sorted(links - anchors)


def test_size():
    assert GAP.stat().st_size <= MAX_BYTES
