"""The exercises: every one's tests pass on its stage and fail on its fresh copy; removing bodies keeps the rest."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("exercises_tool", REPO / "tools" / "exercises.py")
exercises = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = exercises  # (dataclasses look their module up while the class is made)
spec.loader.exec_module(exercises)


def test_every_exercise_passes_on_its_stage_and_fails_on_its_fresh_copy():
    """One process for all of them (python tools/exercises.py verify): torch is imported once."""
    proc = subprocess.run([sys.executable, "tools/exercises.py", "verify"], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_there_are_at_least_19_exercises_over_every_stage():
    found = exercises.load()
    assert len(found) >= 19
    assert {ex.stage for ex in found.values()} == {p.name for p in REPO.glob("stage[0-9]_*") if p.is_dir()}


SOURCE = '''
class Cache:
    def evict(self, size: int) -> list:
        """Take back `size` tokens."""
        # the walk below is the answer
        out = []
        for i in range(size):
            out.append(i)
        return out

    @property
    def size(self) -> int:
        return 3


def walk(n):
    # no docstring: this comment is part of the answer
    for i in range(n):
        yield i


async def stream(items):
    for item in items:
        yield item


def helper(
    x: int,
) -> int:
    return x + 1
'''


def test_removing_bodies_keeps_signatures_docstrings_and_the_kind_of_function():
    text = exercises.blank_source(SOURCE, ["Cache.evict", "walk", "stream", "helper"], "demo", "Use a heap.")
    assert "out.append" not in text and "the walk below" not in text and "part of the answer" not in text
    assert '"""Take back `size` tokens."""' in text and "def helper(\n    x: int,\n) -> int:" in text
    assert text.count("# Use a heap.") == 4 and "return 3" in text  # the property is untouched
    namespace: dict = {}
    exec(compile(text, "demo.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="exercise demo: Cache.evict"):
        namespace["Cache"]().evict(2)
    with pytest.raises(NotImplementedError):
        list(namespace["walk"](2))  # still a generator: the error comes when it is iterated
    assert namespace["stream"](1).__class__.__name__ == "async_generator"
    assert ast.parse(text)


def test_start_makes_a_scratch_copy_and_refuses_to_overwrite_it(tmp_path):
    ex = exercises.get("radix-evict")
    dest = exercises.start(ex, tmp_path / "ex")
    radix = (dest / "stage2_scheduled" / "kvcache" / "radix_cache.py").read_text()
    assert "raise NotImplementedError('exercise radix-evict: RadixPrefixCache.evict')" in radix
    assert "heapq.heappop" not in radix  # the answer is gone
    assert (dest / "models").is_symlink() and (dest / "conftest.py").is_file()
    with pytest.raises(exercises.ExerciseError, match="exists"):
        exercises.start(ex, tmp_path / "ex")
    assert exercises.main(["start", "no-such-exercise"]) == 2


def test_each_stage_readme_names_its_exercises():
    for ex in exercises.load().values():
        assert f"`{ex.name}`" in (REPO / ex.stage / "README.md").read_text(), f"{ex.stage}/README.md: {ex.name}"
