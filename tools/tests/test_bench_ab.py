"""`python -m bench ab`: this checkout against another commit in alternating rounds, each run its own worker
process in its own tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import ab

REPO = Path(__file__).resolve().parents[2]


def test_rounds_run_both_trees_for_every_option_set_and_alternate_which_goes_first():
    runs = ab.plan(2, ['{"a": 1}', "{}"], "abc1234")
    assert [(r.round, r.options, r.tree) for r in runs] == [
        (1, '{"a": 1}', ab.THIS), (1, '{"a": 1}', "abc1234"), (1, "{}", ab.THIS), (1, "{}", "abc1234"),
        (2, '{"a": 1}', "abc1234"), (2, '{"a": 1}', ab.THIS), (2, "{}", "abc1234"), (2, "{}", ab.THIS),
    ]


def test_summary_pairs_each_round_and_reports_the_change():
    runs = ab.plan(3, ["{}", "{\"b\": 2}"], "base")
    values = {("{}", ab.THIS): [102.0, 101.0, 103.0], ("{}", "base"): [100.0, 100.0, 100.0],
              ('{"b": 2}', ab.THIS): [50.0, 50.0, 50.0], ('{"b": 2}', "base"): [50.0, 52.0, 51.0]}
    results = [(r, values[(r.options, r.tree)][r.round - 1]) for r in runs]
    plain, other = ab.summarize(results, "base")
    assert plain["differences"] == [2.0, 1.0, 3.0] and plain["change_pct"] == pytest.approx(2.0)
    assert other["options"] == '{"b": 2}' and other["differences"] == [0.0, -2.0, -1.0]
    assert other["base_mean"] == pytest.approx(51.0) and other["this_mean"] == pytest.approx(50.0)
    # a round that ran on one side only (a stopped comparison) is left out of the pairs
    assert ab.summarize(results[:-1], "base")[1]["rounds"] == 2


def test_ab_runs_both_trees_on_the_cpu(tmp_path):
    """End to end on the tiny model: HEAD's tree is exported and run beside this checkout; the report and the
    runs' JSON name both."""
    tiny = REPO / "models" / "tiny-qwen3"
    if not (tiny / "config.json").exists():
        subprocess.run([sys.executable, "-m", "models", "make", "tiny-qwen3"], cwd=REPO, check=True)
    out = tmp_path / "ab.md"
    subprocess.run([sys.executable, "-m", "bench", "ab", "--base", "HEAD", "--model", str(tiny), "--rounds", "1",
                    "--quick", "--out", str(out)], cwd=REPO, check=True, capture_output=True, timeout=300)
    data = json.loads(out.with_suffix(".json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    assert data["base"] == head.strip() and [r["tree"] for r in data["runs"]] == [ab.THIS, data["base"]]
    assert all(r["tok_s"] > 0 for r in data["runs"]) and data["summary"][0]["rounds"] == 1
    assert f"this checkout against {data['base']}" in out.read_text()


def test_a_revision_that_is_not_a_commit_is_refused_by_name():
    proc = subprocess.run([sys.executable, "-m", "bench", "ab", "--base", "no-such-rev", "--model", "x"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "'no-such-rev' is not a commit" in proc.stderr
