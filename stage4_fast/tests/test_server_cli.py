"""The server's command line and start-up checks: vLLM/SGLang spellings, one-line refusals, checks before loading."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stage4_fast.server import parse_args
from stage4_fast.server.cli import UNSUPPORTED_FLAGS, build_parser

REPO = Path(__file__).resolve().parents[2]


def _parse(tiny_dir: Path, *flags: str):
    return parse_args(["--model", str(tiny_dir), *flags])[0]


@pytest.mark.parametrize("flags, field, value", [
    (["--max-model-len", "512"], "max_seq_len_override", 512),
    (["--context-length", "512"], "max_seq_len_override", 512),
    (["--mem-fraction-static", "0.5"], "memory_ratio", 0.5),
    (["--gpu-memory-utilization", "0.7"], "memory_ratio", 0.7),
    (["--max-num-seqs", "8"], "max_running_req", 8),
    (["--chunked-prefill-size", "128"], "max_extend_tokens", 128),
    (["--max-num-batched-tokens", "256"], "max_extend_tokens", 256),
    (["--block-size", "16"], "page_size", 16),
    (["--disable-radix-cache"], "cache_type", "naive"),
    (["--disable-overlap-schedule"], "overlap_scheduling", False),
    (["--enable-mixed-chunk"], "enable_mixed_chunk", True),
    (["--kv-cache-dtype", "fp8_e4m3", "--calculate-kv-scales"], "calculate_kv_scales", True),
    (["--cache", "naive"], "cache_type", "naive"),
    (["--disable-cuda-graph"], "cuda_graph_max_bs", 0),
    (["--enforce-eager"], "cuda_graph_max_bs", 0),
    (["--disable-prefill-cuda-graph"], "prefill_cuda_graph", False),
    ([], "prefill_cuda_graph", None),
    (["--load-format", "dummy"], "use_dummy_weight", True),
    (["--log-level", "debug"], "log_level", "debug"),
    (["--disable-uvicorn-access-log"], "access_log", False),
    (["--log-level-http", "warning"], "log_level_http", "warning"),
    (["--enable-log-requests"], "log_requests", True),
    (["--log-requests"], "log_requests", True),
    (["--disable-log-requests"], "log_requests", False),
    (["--max-log-len", "40"], "max_log_len", 40),
    (["--tool-call-parser", "hermes"], "tool_call_parser", "hermes"),
    (["--tool-call-parser", "qwen25", "--enable-auto-tool-choice"], "tool_call_parser", "qwen25"),
    (["--reasoning-parser", "qwen3"], "reasoning_parser", "qwen3"),
    (["--reasoning-parser", "deepseek_r1"], "reasoning_parser", "deepseek_r1"),
    (["--dtype", "half"], "dtype", torch.float16),
    (["--dtype", "fp16"], "dtype", torch.float16),
    (["--dtype", "bf16"], "dtype", torch.bfloat16),
    (["--dtype", "float"], "dtype", torch.float32),
    (["--trust-remote-code"], "model_path", None),  # accepted (no effect)
])
def test_vllm_and_sglang_spellings_map_to_our_options(tiny_dir, flags, field, value):
    config = _parse(tiny_dir, *flags)
    assert value is None or getattr(config, field) == value


@pytest.mark.parametrize("flags, access_log, level", [
    ([], True, "info"),
    (["--disable-uvicorn-access-log"], False, "info"),
    (["--log-level-http", "warning"], True, "warning"),
    (["--log-level", "error"], True, "error"),  # uvicorn follows --log-level unless told otherwise
    (["--log-level", "error", "--log-level-http", "debug"], True, "debug"),
])
def test_the_http_server_takes_its_log_flags(tiny_dir, flags, access_log, level):
    from stage4_fast.server.launch import _http_server

    backend = {"max_seq_len": 64, "num_pages": 64, "page_size": 1, "vocab_size": 100}
    server, _ = _http_server(_parse(tiny_dir, *flags), backend)
    assert server.config.access_log is access_log and server.config.log_level == level


@pytest.mark.parametrize("flag", ["-tp", "--tp", "--tp-size", "--tensor-parallel-size"])
def test_every_tp_spelling(tiny_dir, flag):
    assert _parse(tiny_dir, flag, "2").tp_info.size == 2


def _refusal(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m stage4_fast: error: "), err  # one line, no usage block
    return err


@pytest.mark.parametrize("flag", sorted(UNSUPPORTED_FLAGS))
def test_a_known_flag_we_do_not_offer_is_refused_with_the_reason(capsys, flag):
    assert f"{flag} is not supported: {UNSUPPORTED_FLAGS[flag]}" in _refusal(capsys, [flag])


@pytest.mark.parametrize("flag, suggestion", [("--mdoel", "--model"), ("--max-model-length", "--max-model-len"),
                                              ("--gpu-memory-utilisation", "--gpu-memory-utilization")])
def test_a_typo_gets_did_you_mean(capsys, flag, suggestion):
    assert f"unknown flag {flag} (did you mean {suggestion}?)" in _refusal(capsys, [flag, "1"])


def test_prefixes_are_not_guessed(capsys):
    """`--tokenizer` must not silently mean `--tokenizer-count`, nor `--max-running` a flag it happens to start."""
    assert "unknown flag --max-running" in _refusal(capsys, ["--max-running", "4"])


@pytest.mark.parametrize("argv, says", [
    (["--port", "99999"], "argument --port: a TCP port is 1..65535, got 99999"),
    (["--port", "http"], "argument --port: expected an integer, got 'http'"),
    (["--model", "/nonexistent/model"], "no model directory at /nonexistent/model"),
    (["--model", str(REPO / "stage4_fast")], "has no config.json"),
    (["--attn", "flash"], "unsupported attention backend 'flash'"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "mistral"], "argument --tool-call-parser: invalid choice: 'mistral'"),
    (["--shell", "--reasoning-parser", "qwen3"], "--reasoning-parser: the shell reads no tool calls or reasoning"),
])
def test_bad_values_are_one_line(capsys, argv, says):
    assert says in _refusal(capsys, argv)


def test_a_model_without_weights_or_a_known_architecture_fails_before_loading(capsys, tmp_path, tiny_dir):
    no_weights, unknown_arch = tmp_path / "no-weights", tmp_path / "unknown-arch"
    for model in (no_weights, unknown_arch):
        model.mkdir()
        for f in tiny_dir.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json":
                (model / f.name).symlink_to(f)
    (no_weights / "config.json").symlink_to(tiny_dir / "config.json")
    (unknown_arch / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "llama"}')
    assert "has no *.safetensors weights (--dummy-weight runs with random ones)" in _refusal(
        capsys, ["--model", str(no_weights)])
    parse_args(["--model", str(no_weights), "--dummy-weight"])  # fine without weights
    assert "architecture NoSuchForCausalLM is not supported" in _refusal(capsys, ["--model", str(unknown_arch)])


def test_help_has_a_line_and_default_for_every_flag_and_names_the_backends(capsys):
    parser = build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    parser.print_help()
    text = capsys.readouterr().out
    assert "one of torch, triton, fi, fa" in text and "one of fused, fused_sorted, torch" in text
    for default in ("(default: 1919)", "(default: 256)", "(default: 8192)", "(default: radix)", "(default: auto)"):
        assert default in text


def test_the_served_model_id_is_the_directory_name_and_the_path_works_too(tiny_dir):
    config = _parse(tiny_dir)
    assert config.served_model_name == tiny_dir.name == config.model_ids[0]
    assert str(tiny_dir) in config.model_ids
    named = _parse(tiny_dir, "--served-model-name", "my-model")
    assert named.model_ids[0] == "my-model" and str(tiny_dir) in named.model_ids


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_usage_names_the_command_that_was_run():
    assert _run("stage4_fast.serve", "--help").stdout.startswith("usage: python -m stage4_fast.serve ")
    assert _run("stage4_fast", "--nope").stderr.startswith("python -m stage4_fast: error: unknown flag --nope")


def test_a_port_in_use_fails_before_loading(tiny_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run("stage4_fast", "--model", str(tiny_dir), "--port", str(port))
    assert result.returncode == 2
    assert result.stderr == (f"python -m stage4_fast: error: cannot listen on 127.0.0.1:{port}: Address already in "
                             "use (is another server running there? pick another --port)\n")
    assert result.stdout == ""  # no worker started, nothing loaded


def test_tp_rendezvous_port_is_checked_too(tiny_dir):
    result = _run("stage4_fast", "--model", str(tiny_dir), "--port", "65535", "--tp", "2")
    assert result.returncode == 2 and "rendezvous (--port + 1) would be port 65536" in result.stderr
