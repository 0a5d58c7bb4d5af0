"""The isolation check itself: clean on the repo, and it catches a cross-stage import."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("stages_tool", Path(__file__).resolve().parents[1] / "stages.py")
stages_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stages_tool)


def test_repo_stages_are_isolated():
    assert stages_tool.check() == []


def test_cross_stage_import_is_reported(tmp_path, monkeypatch):
    for name in ("stage0_tiny", "stage1_correct"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "stage1_correct" / "bad.py").write_text("from stage0_tiny import tiny\nimport torch\n")
    monkeypatch.setattr(stages_tool, "REPO", tmp_path)
    problems = stages_tool.check()
    assert len(problems) == 1 and "stage0_tiny" in problems[0]
