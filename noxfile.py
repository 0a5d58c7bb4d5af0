"""Test sessions. They run in the current environment (``venv_backend="none"``): the README's install line sets it
up once, so no session spends minutes reinstalling torch.

    nox -s stage2        # stage2's own tests + the shared HF-alignment suite for stage2
    nox -s tests         # every stage, one pytest run (models prepared once)
    nox -s lint          # ruff
    nox -s reliability   # the servers' reliability/security tests (fuzzing, storm, load, auth, shutdown)
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "tests"]

STAGES = ["stage0_tiny", "stage1_correct", "stage2_scheduled", "stage3_served", "stage4_fast"]


def _stage_args(stage: str) -> list[str]:
    tests = Path(stage) / "tests"
    return ([str(tests)] if tests.is_dir() else []) + ["shared_tests", "--stage", stage]


def _make_stage_session(index: int, stage: str) -> None:
    @nox.session(name=f"stage{index}")
    def _session(session: nox.Session) -> None:
        session.run("python", "-m", "pytest", *_stage_args(stage), *session.posargs)

    _session.__doc__ = f"{stage}: its own tests + the shared suite"


for _i, _stage in enumerate(STAGES):
    _make_stage_session(_i, _stage)


@nox.session
def tests(session: nox.Session) -> None:
    """All stages' tests and the shared suite for every stage, in one pytest run."""
    paths = [str(Path(s) / "tests") for s in STAGES if (Path(s) / "tests").is_dir()]
    session.run("python", "-m", "pytest", *paths, "shared_tests", "tools/tests", *session.posargs)


@nox.session
def reliability(session: nox.Session) -> None:
    """Every served stage's tests/reliability (also part of ``tests``, which collects each tests dir recursively)."""
    paths = [str(p) for s in STAGES if (p := Path(s) / "tests" / "reliability").is_dir()]
    session.run("python", "-m", "pytest", *paths, "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.run("ruff", "check", ".")
    session.run("python", "tools/stages.py", "check")
