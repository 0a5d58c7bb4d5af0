"""One model over two machines, simulated on one: two process trees started by two commands, TP 2 each = TP 4 over
gloo on 127.0.0.1 (SGLang's `--tp 4 --nnodes 2 --node-rank R --dist-init-addr HOST:PORT`). Node 0 serves the API;
node 1 runs ranks 2..3 only. Losing either machine stops the other, with a message and no process left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from stage4_fast.harness import free_port, server_process
from stage4_fast.server import parse_args

from .conftest import REPO, prepared_model
from .fast_helpers import hf_generate

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 200, 300]]
NEW_TOKENS = 8


def node_flags(node_rank: int, dist_port: int, tp: int = 4) -> list[str]:
    return ["--tp", str(tp), "--nnodes", "2", "--node-rank", str(node_rank), "--dist-init-addr",
            f"127.0.0.1:{dist_port}"]


@contextmanager
def start_node1(model: Path, dist_port: int, tp: int = 4,
                env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Node 1's command, as a second machine would run it (its own session: its own process tree)."""
    cmd = [sys.executable, "-m", "stage4_fast", "--model", str(model), "--dtype", "float32", "--num-pages", "256",
           *node_flags(1, dist_port, tp)]
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        proc.log = log  # type: ignore[attr-defined]
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def node_log(proc: subprocess.Popen) -> str:
    log = proc.log  # type: ignore[attr-defined]
    log.seek(0)
    return log.read().decode(errors="replace")


def complete(base_url: str, prompt: list[int]) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def _tree(pid: int) -> list[psutil.Process]:
    return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]


def _alive(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_two_nodes_of_two_ranks_equal_hf_and_losing_node1_stops_node0():
    model = prepared_model("tiny-qwen3")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    want = [tokenizer.decode(ids) for ids in hf_generate(model, PROMPTS, NEW_TOKENS)]
    dist_port = free_port()
    with start_node1(model, dist_port) as node1, \
            server_process(str(model), tp=4, num_pages=256, extra_args=node_flags(0, dist_port)) as node0:
        assert [complete(node0.base_url, p) for p in PROMPTS] == want
        assert "rank 3/4" in node_log(node1) and "rank 1/4" in node0.log()  # each node ran its own two ranks
        assert "rank 2/4" not in node0.log()
        node0_tree = _tree(node0.proc.pid)

        os.killpg(node1.pid, signal.SIGKILL)  # the second machine goes away
        assert node0.proc.wait(60) == 1
        assert _alive(node0_tree, 30) == []
        assert "lost node 1 (TP ranks 2..3): Connection closed by peer" in node0.log()
        assert "shutting the server down" in node0.log()


def test_stopping_node0_stops_node1():
    model = prepared_model("tiny-qwen3")
    dist_port = free_port()
    with start_node1(model, dist_port) as node1, \
            server_process(str(model), tp=4, num_pages=256, extra_args=node_flags(0, dist_port)) as node0:
        node1_tree = _tree(node1.pid)
        assert node0.stop() == 0  # SIGTERM, as an operator would
        assert node1.wait(60) == 0, node_log(node1)
        assert _alive(node1_tree, 30) == []
        assert "node 0 (TP ranks 0..1) stopped; stopping this node's ranks" in node_log(node1)
        assert "Traceback" not in node0.log() + node_log(node1)


@pytest.mark.parametrize("flags, message", [
    (["--tp", "4", "--nnodes", "2"], "--dist-init-addr HOST:PORT (node 0's address) is required"),
    (["--tp", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"], "--tp 3 (the total rank count) does not"),
    (["--tp", "4", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:5000"],
     "--node-rank 2 must be in 0..1"),
    (["--tp", "4", "--nnodes", "2", "--dist-init-addr", "127.0.0.1"], "'127.0.0.1' is not HOST:PORT"),
])
def test_multi_node_flag_errors_are_one_line_before_loading(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", str(prepared_model("tiny-qwen3")), *flags])
    assert message in capsys.readouterr().err


def test_node_layout():
    model = str(prepared_model("tiny-qwen3"))
    config, _ = parse_args(["--model", model, *node_flags(1, 5000)])
    assert list(config.local_tp_ranks) == [2, 3] and config.ranks_per_node == 2
    assert config.distributed_addr == "tcp://127.0.0.1:5000"
    assert config.zmq_scheduler_broadcast_addr == "tcp://127.0.0.1:5001"  # rank 0's step broadcast leaves the host
    assert config.node_link_addr == ("127.0.0.1", 5002)
    single, _ = parse_args(["--model", model, "--tp", "2"])
    assert single.zmq_scheduler_broadcast_addr.startswith("ipc://")  # one machine: unchanged


def test_node0_with_a_busy_port_fails_in_one_line_before_loading():
    model = prepared_model("tiny-qwen3")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        dist_port = busy.getsockname()[1] - 1  # PORT + 1, rank 0's step broadcast, is taken
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-m", "stage4_fast", "--model", str(model), "--port", str(free_port()),
                              *node_flags(0, dist_port)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=120)
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()
    # (PORT itself is free unless some other process just took it: then the message names that one)
    assert re.fullmatch(r"python -m stage4_fast: error: .+ \(--dist-init-addr port \+ [01]\) needs port \d+ on "
                        r"127\.0\.0\.1: .+; pick another --dist-init-addr port", line), line
    assert f"step broadcast (--dist-init-addr port + 1) needs port {dist_port + 1}" in line or "+ 0" in line


def test_offline_llm_refuses_several_machines():
    from stage4_fast import LLM

    with pytest.raises(ValueError, match="the offline LLM runs on one machine"):
        LLM(str(prepared_model("tiny-qwen3")), tp=2, nnodes=2)
