"""`--api-server-count N`: N API server processes on one port, the work spread over them, one server to the client
(answers, usage, /metrics) and to the lifecycle rules (signals, a process that dies)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import threading

import httpx
import psutil
import pytest

from stage4_fast.harness import server_process
from stage4_fast.message import UserReply
from stage4_fast.server import parse_args
from stage4_fast.server.launch import STOP_TIMEOUT_S
from stage4_fast.tokenizer.server import _by_api_server

API_SERVERS = ["--api-server-count", "2"]
# how long a test waits for the launcher to exit once it stops. The launcher bounds its own stop (STOP_TIMEOUT_S for
# every worker together, then SIGKILL, logged), so this bound only has to catch a launcher that never exits; it leaves
# a loaded 2-core machine room, where a worker's exit and the interpreters' teardown, starved of CPU, take seconds each
# (0.5 s quiet, 4-10 s at load average 12)
LAUNCHER_EXIT_S = STOP_TIMEOUT_S + 50
TITLES = ["minisgl::api_server_0", "minisgl::api_server_1", "minisgl::scheduler_0", "minisgl::tokenizer+detokenizer"]


def _titles(pid: int) -> list[str]:
    titles = []
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            titles.append(" ".join(proc.cmdline()).strip())  # setproctitle pads the title with spaces
        except psutil.Error:
            pass
    return sorted(t for t in titles if t.startswith("minisgl::"))


def _child(pid: int, title: str) -> psutil.Process:
    return next(p for p in psutil.Process(pid).children(recursive=True) if " ".join(p.cmdline()).strip() == title)


def _own_files(pid: int) -> list[str]:
    return [p for p in os.listdir("/tmp") if p.startswith("minisgl_") and f".pid={pid}" in p]


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _streamed(base_url: str, body: dict) -> tuple[str, dict]:
    """One streamed completion on a new connection: its text and its usage chunk."""
    text, usage = "", None
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return text, usage


def test_routing_keeps_each_api_servers_replies_in_order():
    replies = [UserReply(uid, str(uid), False) for uid in (4, 1, 6, 3, 2, 7)]
    assert _by_api_server(replies, 1) == [(0, replies)]
    assert _by_api_server([], 1) == []
    groups = dict(_by_api_server(replies, 2))
    assert [r.uid for r in groups[0]] == [4, 6, 2] and [r.uid for r in groups[1]] == [1, 3, 7]


def test_the_shell_takes_no_api_servers(capsys, tiny_dir):
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tiny_dir), "--shell", *API_SERVERS])
    assert "--api-server-count 2: the shell serves no HTTP" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tiny_dir), "--api-server-count", "0"])
    assert parse_args(["--model", str(tiny_dir), *API_SERVERS])[0].api_server_count == 2


def test_an_api_server_answers_only_once_the_launcher_says_every_one_is_up(tiny_dir):
    """An API server process that acked waits for the launcher's word (every one acked, the watchdog running)
    before it answers anything: with a /health that answered as soon as one process served, a client (or a test)
    took a half-started server for a running one, and a worker that died then was reported "during start-up"."""
    from stage4_fast.server.launch import _http_server
    from stage4_fast.server.preflight import bind_listener

    probe = bind_listener("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    # (one API server's configuration: this process's metrics are not the multiprocess files the gate is beside)
    config = parse_args(["--model", str(tiny_dir), "--host", "127.0.0.1", "--port", str(port)])[0]
    listener = bind_listener(config.server_host, port)
    url = f"http://127.0.0.1:{port}/health"
    acked, serving = threading.Event(), threading.Event()
    backend = {"max_seq_len": 64, "num_pages": 64, "page_size": 1, "vocab_size": 100}
    server, _ = _http_server(config, backend, on_ready=acked.set, serving=serving, follow_launcher=True)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        assert acked.wait(30)
        with pytest.raises((httpx.ConnectError, httpx.TimeoutException)):  # nobody listens yet
            httpx.get(url, timeout=1.0)
        serving.set()
        assert httpx.get(url, timeout=10).json() == {"status": "ok"}
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


@pytest.mark.parametrize("tokenizers", [0, 2])
def test_two_api_servers_answer_as_one(tiny_dir, tiny_server, tokenizers):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    expected, _ = _streamed(tiny_server.base_url, body)  # one API server's answer (fp32 greedy: any page size's)
    with server_process(str(tiny_dir), extra_args=[*API_SERVERS, "--num-tokenizer", str(tokenizers)]) as server:
        if not tokenizers:  # (with tokenizer workers, a detokenizer and minisgl::tokenizer_0 / _1 instead)
            assert _titles(server.proc.pid) == TITLES
        # every connection is new: the kernel hashes each to one process's socket
        answered_by = {httpx.get(f"{server.base_url}/v1/stats").json()["frontend"]["api_server"] for _ in range(24)}
        assert answered_by == {0, 1}
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda _: _streamed(server.base_url, body), range(32)))
        assert {text for text, _ in results} == {expected}  # greedy: every request the single server's text
        assert all(usage["completion_tokens"] == 12 for _, usage in results)
        # /metrics from either process sums both: every request and token counted once
        for _ in range(4):
            metrics = httpx.get(f"{server.base_url}/metrics").text
            assert _metric(metrics, 'minisgl_http_requests_total{endpoint="/v1/completions",status="200"}') == 32
            assert _metric(metrics, "minisgl_generation_tokens_total") == 32 * 12
            assert _metric(metrics, "minisgl_num_inflight_requests") == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_api_server(tiny_dir, sig):
    with server_process(str(tiny_dir), extra_args=API_SERVERS) as server:
        pid = server.proc.pid
        workers = psutil.Process(pid).children(recursive=True)
        assert [p for p in _own_files(pid) if p.startswith("minisgl_metrics")], "the Prometheus files' directory"
        if sig == signal.SIGINT:  # Ctrl-C in a terminal reaches the whole process group: the launcher decides
            # an API server process ignores it (as the workers do), so a SIGINT to one alone stops nothing
            child = _child(pid, "minisgl::api_server_1")
            child.send_signal(signal.SIGINT)
            with pytest.raises(psutil.TimeoutExpired):
                child.wait(2)
            answered_by = {httpx.get(f"{server.base_url}/v1/stats").json()["frontend"]["api_server"] for _ in range(24)}
            assert answered_by == {0, 1} and server.proc.poll() is None
            os.killpg(pid, signal.SIGINT)
        else:
            server.proc.send_signal(sig)
        assert server.proc.wait(LAUNCHER_EXIT_S) == 0  # a worker that hung is killed and logged (checked below)
        _, alive = psutil.wait_procs(workers, timeout=15)
        assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
        assert _own_files(pid) == []  # ipc files and the Prometheus files' directory
        log = server.log()
        assert "Traceback" not in log
        assert "did not stop within" not in log, "a worker ignored SIGTERM and was killed"


def test_a_dead_worker_ends_the_streams_of_every_api_server(tiny_dir):
    with server_process(str(tiny_dir), extra_args=API_SERVERS) as server:
        pid = server.proc.pid
        body = {"prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        streaming = threading.Barrier(9)  # the 8 streams, each past its first chunk, and this thread

        def stream() -> list[str]:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: {"))
                streaming.wait(30)
                return [first, *(line for line in lines if line)]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(stream) for _ in range(8)]
            streaming.wait(30)
            _child(pid, "minisgl::scheduler_0").kill()
            results = [done.result() for done in streams]
        for lines in results:  # on either process (8 connections, 2 sockets): an error event, then the end
            assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
        assert server.proc.wait(LAUNCHER_EXIT_S) == 1
        log = server.log()
        # the message names the log's own lines (uvicorn's left out) should the watchdog ever report another worker
        assert re.search(r"worker minisgl-\S+ \(pid \d+\) was killed by signal 9; shutting the server down",
                         log), "\n".join(line for line in log.splitlines() if line.startswith("["))


def test_a_dead_api_server_brings_the_server_down(tiny_dir):
    with server_process(str(tiny_dir), extra_args=API_SERVERS) as server:
        _child(server.proc.pid, "minisgl::api_server_1").kill()
        assert server.proc.wait(LAUNCHER_EXIT_S) == 1
        assert re.search(r"worker minisgl-api-server-1 \(pid \d+\) was killed by signal 9", server.log())
