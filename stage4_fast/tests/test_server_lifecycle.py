"""Start-up, shutdown and worker death of the real process tree; the shell in a real terminal (a pty)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import httpx
import psutil
import pytest

from stage4_fast.harness import free_port, server_process


def _workers(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _all_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _ipc_files(pid: int) -> list[str]:
    return [p for p in os.listdir("/tmp") if p.startswith("minisgl_") and f".pid={pid}" in p]


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()).strip()  # setproctitle pads the title with spaces
    except psutil.Error:
        return ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_process(tiny_dir, sig):
    with server_process(str(tiny_dir)) as server:
        pid = server.proc.pid
        workers = _workers(pid)
        # named in `ps` (the third child is multiprocessing's resource tracker)
        titles = sorted(t for t in map(_title, workers) if t.startswith("minisgl::"))
        assert titles == ["minisgl::scheduler_0", "minisgl::tokenizer+detokenizer"], list(map(_title, workers))
        assert _ipc_files(pid)
        if sig == signal.SIGINT:  # Ctrl-C in a terminal reaches the whole process group
            os.killpg(pid, signal.SIGINT)
        else:
            server.proc.send_signal(sig)
        assert server.proc.wait(30) == 0
        assert _all_gone(workers, 15) == []
        assert _ipc_files(pid) == []
        assert "Traceback" not in server.log()


def test_dead_worker_brings_the_server_down_with_a_message(tiny_dir):
    with server_process(str(tiny_dir)) as server:
        workers = _workers(server.proc.pid)
        scheduler = next(p for p in workers if _title(p) == "minisgl::scheduler_0")
        # a stream in flight when the worker dies ends with an error event, not silence
        body = {"prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            victim = psutil.Process(scheduler.pid)
            victim.kill()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
        assert server.proc.wait(30) == 1
        assert _all_gone(workers, 15) == []
        log = server.log()
        assert re.search(r"worker minisgl-\S+ \(pid \d+\) was killed by signal 9; shutting the server down", log)
        assert "leaked semaphore" not in log  # tqdm's multiprocessing lock in the killed worker
        assert _ipc_files(server.proc.pid) == []


def test_worker_dying_during_start_up_is_reported(tmp_path, tiny_dir):
    bad = tmp_path / "corrupt-weights"  # passes the start-up checks; the scheduler dies reading the weights
    bad.mkdir()
    for f in tiny_dir.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).symlink_to(f)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1 .*scheduler \(pid \d+\) exited with code 1 "
                                           r"during start-up"):
        with server_process(str(bad), startup_timeout_s=120):
            pass


def test_failed_tp_start_leaves_no_ipc_file(tmp_path, tiny_dir):
    """Both ranks die reading the weights: the server exits 1 and removes every socket file of its run."""
    bad = tmp_path / "corrupt-weights"
    bad.mkdir()
    for f in tiny_dir.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).symlink_to(f)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "stage4_fast", "--model", str(bad), "--tp", "2", "--port",
                             str(free_port())], cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = proc.communicate(timeout=180)[0]
    assert proc.returncode == 1 and "during start-up" in log, log
    assert _ipc_files(proc.pid) == []
    assert "leaked semaphore" not in log


# escape sequences a terminal program writes (CSI ..., OSC ... BEL, and the two-byte ones), for matching visible text
_ANSI = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_=>])")


def _read_until(fd: int, pattern: str, timeout_s: float, visible: bool = False) -> str:
    """Read the pty until `pattern` matches what came out (with visible=True: the output without escape
    sequences)."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
            text = out.decode(errors="replace")
            if re.search(pattern, _ANSI.sub("", text) if visible else text):
                return text
    raise AssertionError(f"{pattern!r} not seen in {out.decode(errors='replace')!r}")


def _own_terminal() -> None:
    """In the child: a new session whose controlling terminal is the pty (stdin), as in a real terminal, so Ctrl-C
    outside prompt_toolkit's raw mode becomes SIGINT for the shell's whole process group."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.fixture
def shell(tiny_dir):
    """`--shell` on tiny Qwen3 in a pty of its own: (process, the pty's master end). Answers are long (the random
    model rarely says EOS within 1000 tokens), so a Ctrl-C sent once the answer shows still finds it streaming."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo), MINISGL_SHELL_MAX_TOKENS="1000", TERM="xterm",
               PROMPT_TOOLKIT_NO_CPR="1")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "stage4_fast", "--model", str(tiny_dir), "--shell"],
                            cwd=repo, env=env, stdin=slave, stdout=slave, stderr=slave, preexec_fn=_own_terminal)
    os.close(slave)
    try:
        # the banner (every worker is up), then the first prompt: drawn once the terminal is in raw mode
        _read_until(master, r"at an empty prompt, quits[\r\n]+>", 180, visible=True)
        yield proc, master
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(master)


def _ask(master: int, question: str) -> str:
    """Type a question and wait for visible answer text. The shell prints it only after the prompt has handed the
    terminal back (ISIG on, echo off): a key sent while the prompt was still finishing (only its escape sequences
    out) would go to the prompt instead."""
    os.write(master, question.encode() + b"\r")
    return _read_until(master, re.escape(question) + r"[\r\n]+\s*\S{3}", 120, visible=True)


def test_shell_in_a_terminal(shell):
    """Type into `--shell` through a pty: Ctrl-C stops an answer and the shell goes on; text typed during an answer
    is not echoed into it; /reset works; Ctrl-C clears a typed line, and at the empty prompt quits cleanly with no
    worker left."""
    proc, master = shell
    workers = _workers(proc.pid)
    _ask(master, "hello there")
    # keys typed now are not echoed into the answer (termios on a pty's master end reads the terminal's settings;
    # the echo itself cannot be waited for: a Ctrl-C right after the keys discards their pending echo)
    assert not termios.tcgetattr(master)[3] & termios.ECHO
    os.write(master, b"\x03")  # Ctrl-C while it streams
    _read_until(master, r"\[stopped\][\r\n]+>", 60, visible=True)  # and a new prompt
    _ask(master, "tell me more")  # the shell goes on
    os.write(master, b"\x03")
    # Each key below waits for the prompt drawn after the previous output: prompt_toolkit draws it once the terminal
    # is in raw mode, where Ctrl-C is a key; before that it is SIGINT, which at a prompt that is opening quits.
    _read_until(master, r"\[stopped\][\r\n]+>", 60, visible=True)
    os.write(master, b"one two")
    _read_until(master, r"one two", 30, visible=True)
    os.write(master, b"\x03")  # clears the line: the shell is still there
    os.write(master, b"/reset\r")
    _read_until(master, r"conversation cleared\)[\r\n]+>", 30, visible=True)
    os.write(master, b"\x03")  # at the empty prompt: quits
    _read_until(master, r"bye", 30)
    assert proc.wait(30) == 0
    assert _all_gone(workers, 15) == []


def test_shell_quits_on_ctrl_d_at_an_empty_prompt(shell):
    proc, master = shell
    os.write(master, b"\x04")
    _read_until(master, r"bye", 30)
    assert proc.wait(30) == 0


def test_shell_defaults_answer_briefly(monkeypatch):
    """Greedy and 256 tokens unless MINISGL_SHELL_MAX_TOKENS etc. say otherwise (upstream's 0.6 and 2048 made a small
    model ramble for half a minute)."""
    from stage4_fast.server.shell import _shell_sampling_params

    for name in ("MINISGL_SHELL_MAX_TOKENS", "MINISGL_SHELL_TEMPERATURE", "MINISGL_SHELL_TOP_K", "MINISGL_SHELL_TOP_P"):
        monkeypatch.delenv(name, raising=False)
    params = _shell_sampling_params(max_seq_len=8192)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.0, -1, 1.0, 256)
    monkeypatch.setenv("MINISGL_SHELL_MAX_TOKENS", "1000")
    monkeypatch.setenv("MINISGL_SHELL_TEMPERATURE", "0.7")
    params = _shell_sampling_params(max_seq_len=512)
    assert (params.temperature, params.max_tokens) == (0.7, 512)  # capped by the context
