"""`python -m bench`: one entry point whose commands dispatch to the modules, and runs that leave the committed
results alone unless asked (`--out bench/results`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import __main__ as front  # noqa: E402
from bench import meta, run  # noqa: E402


def test_unknown_command_is_refused_by_name(capsys):
    assert front.main(["benchmark-everything"]) == 2
    err = capsys.readouterr().err
    assert "'benchmark-everything'" in err and "serve" in err


def test_every_command_answers_help():
    for command in ("run", "serve", "worker", "breakdown", "tp", "tp-logits"):
        proc = subprocess.run([sys.executable, "-m", "bench", command, "--help"], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0 and f"python -m bench {command}" in proc.stdout.replace("[run]", "run"), \
            proc.stderr


def test_a_run_writes_to_the_scratch_folder_unless_asked(tmp_path, monkeypatch):
    """`python -m bench --quick` once rewrote committed results files; by default a run writes to bench/local/."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000, "num_attention_heads": 4}))
    local = tmp_path / "local"
    monkeypatch.setattr(meta, "LOCAL", local)
    before = {p.name: p.stat().st_mtime_ns for p in meta.RESULTS.iterdir()}
    measured = []

    def fake_job(job, args, log_dir):
        measured.append(job.key)
        return {"stage": job.stage, "tasks": job.tasks, "options": job.options, "error": "not measured in a test",
                "seconds": 0.0, "foreign_cpu": 0.0, "log": ""}

    monkeypatch.setattr(run, "run_job", fake_job)
    run.main(["--quick", "--stages", "hf", "--no-serve", "--no-ablations", "--model", str(model)])
    assert measured == ["main:hf"]
    assert (local / "cpu-quick.md").exists() and (local / "cpu-quick.json").exists()
    assert {p.name: p.stat().st_mtime_ns for p in meta.RESULTS.iterdir()} == before


def test_paths_print_relative_to_the_repo_without_following_symlinks(tmp_path):
    link = REPO / "bench" / "local" / "test-link"
    link.parent.mkdir(exist_ok=True)
    link.unlink(missing_ok=True)
    os.symlink(tmp_path, link)
    try:
        assert meta.relative(link) == "bench/local/test-link"
    finally:
        link.unlink()
    assert meta.relative(tmp_path) == str(tmp_path)


def test_percentile_is_nearest_rank():
    assert meta.pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert meta.pct([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
    assert meta.pct([5.0], 0.9) == 5.0


def test_a_written_up_results_file_is_never_overwritten(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000, "num_attention_heads": 4}))
    (tmp_path / "h200.md").write_text("# One H200: what was measured, and how\n")
    monkeypatch.setattr(run, "run_job", lambda *a: (_ for _ in ()).throw(AssertionError("measured anyway")))
    try:
        run.main(["--machine", "h200", "--out", str(tmp_path), "--stages", "hf", "--model", str(model)])
    except SystemExit as e:
        assert "written by hand" in str(e)
    else:
        raise AssertionError("no refusal")
    assert (tmp_path / "h200.md").read_text() == "# One H200: what was measured, and how\n"


def test_breakdown_with_a_stub_forward_times_the_hosts_part_of_the_gpu_workload(tmp_path):
    """`python -m bench breakdown --stub-forward`: the GPU's workload (here its first 8 requests) through the real
    scheduler on the CPU, the forward an instant token source; every request gets its length, every loop its parts."""
    models = REPO / "models"
    if not (models / "tiny-qwen3" / "config.json").exists():
        subprocess.run([sys.executable, "-m", "models", "make", "tiny-qwen3"], cwd=REPO, check=True)
    out = tmp_path / "breakdown.json"
    run = subprocess.run([sys.executable, "-m", "bench", "breakdown", "--stub-forward", "--seqs", "8", "--json",
                          str(out), "--options", '{"attention_backend": "triton"}'],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(out.read_text())
    timed = res["timed"]
    assert timed["wrong_lengths"] == 0 and timed["output_tokens"] > 8 * 100  # the GPU workload's lengths
    # the stub's tokens, not a model's: a request's next token is its last one + 104729 (mod vocab - 200)
    step = 104729 % (49152 - 200)
    for tokens in res["first_tokens"]:
        assert all((b - a) % (49152 - 200) == step for a, b in zip(tokens, tokens[1:])), tokens
    assert timed["host_parts"]["launched prefill"]["loops"] >= 1
    bad = subprocess.run([sys.executable, "-m", "bench", "breakdown", "--stub-forward", "--gpu"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--stub-forward runs on the CPU" in bad.stderr
