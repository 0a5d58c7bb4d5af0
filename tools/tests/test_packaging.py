"""`pip install -e .` installs the stage packages only: no generic top-level names (`models`, `bench`, `tools`) that
would shadow or clash with other projects' packages; those folders run from the repository root instead."""

import sys
from pathlib import Path

import pytest
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]


def test_only_stage_packages_are_installed():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    import tomllib

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    top = {p.split(".")[0] for p in find_packages(str(REPO), include=find["include"], exclude=find.get("exclude", ()))}
    assert top == {"stage0_tiny", "stage1_correct", "stage2_scheduled", "stage3_served", "stage4_fast"}
