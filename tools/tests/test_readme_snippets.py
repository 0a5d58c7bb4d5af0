"""Every ```python block of the READMEs compiles, and each one that needs no running server runs as copied: saved to
a file and run from the repository root (so a snippet that starts processes must carry its `__main__` guard)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READMES = ["README.md", "*/README.md", "shared_tests/*.md"]
SERVER_MARK = "http://127.0.0.1"  # a snippet that talks to a server it does not start: compiled only
MODEL_PATH = re.compile(r"""["']models/([\w.-]+)["']""")


def _python_blocks() -> list[tuple[str, str]]:
    """(file:line, code) of every ```python block."""
    blocks = []
    for pattern in READMES:
        for readme in sorted(REPO.glob(pattern)):
            text = readme.read_text()
            for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
                line = text.count("\n", 0, match.start()) + 2
                blocks.append((f"{readme.relative_to(REPO)}:{line}", match.group(1)))
    return blocks


BLOCKS = _python_blocks()
RUNNABLE = [(where, code) for where, code in BLOCKS if SERVER_MARK not in code]


def test_the_readmes_have_python_snippets():
    assert len(BLOCKS) >= 3 and RUNNABLE


@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_snippet_compiles(where, code):
    compile(code, where, "exec")


@pytest.mark.parametrize("where, code", RUNNABLE, ids=[where for where, _ in RUNNABLE])
def test_snippet_runs_as_copied(where, code, tmp_path):
    import models

    for name in MODEL_PATH.findall(code):  # the models a snippet names, prepared as the README's install line does
        models.ensure(name)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, f"{where} failed:\n{proc.stderr[-3000:]}"
