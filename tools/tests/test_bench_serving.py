"""The serving benchmark's load generators, without a server: which prompts each run sends, and when."""

import asyncio
import contextlib
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import worker  # noqa: E402
from bench.workloads import SIZES  # noqa: E402


def test_serve_runs_never_repeat_a_prompt(monkeypatch):
    """A prompt sent twice to one server comes from its radix cache the second time (no prefill), which once made
    the 16-client run look faster: the warm-up and every run must send prompts of their own."""
    sent: list[tuple[int, ...]] = []

    async def fake_run_clients(url, w, concurrency, http_client=None, warm_connections=False):
        sent.extend(tuple(p) for p in w.prompts)
        return {"concurrency": concurrency, "clock_s": [0.0, 1.0], **worker._summary([], 1.0)}

    @contextlib.contextmanager
    def fake_server(*args, **kwargs):
        yield "http://fake"

    monkeypatch.setattr(worker, "_run_clients", fake_run_clients)
    monkeypatch.setattr(worker, "launch_server", fake_server)
    monkeypatch.setattr(worker, "burst_client_processes", lambda: 1)
    monkeypatch.setattr(worker, "server_ttft_buckets", lambda url: {"0.1": 0, "1.0": 0})
    worker.task_serve("stage3_served", "m", SIZES["cpu", False], 49152, "float32", Path("log"), {})
    assert len(sent) == 1 + sum(SIZES["cpu", False].serve_requests.values())
    assert len(set(sent)) == len(sent)

    sent.clear()
    offline = worker.serve_workload(SIZES["cpu", True], 49152, 4, seed=0)
    worker.task_serve_offline("stage3_served", "m", offline, 49152, "float32", Path("log"), {})
    assert len(set(sent)) == len(sent) == 1 + 4


def test_request_rate_sends_on_a_seeded_poisson_schedule(monkeypatch):
    sent_at: list[float] = []
    loop_start: list[float] = []

    async def fake_stream_one(client, url, prompt, max_tokens):
        sent_at.append(asyncio.get_running_loop().time() - loop_start[0])
        return {"ttft": 0.01, "itl": [0.01], "tokens": max_tokens, "chunks": 2, "tpot": 0.01, "latency": 0.02}

    monkeypatch.setattr(worker, "stream_completion", fake_stream_one)
    w = worker.serve_workload(SIZES["cpu", True], 49152, 6, seed=1)
    rate = 40.0

    async def run():
        loop_start.append(asyncio.get_running_loop().time())
        return await worker._run_rate("http://fake", w, rate, seed=3)

    r = asyncio.run(run())
    rng = random.Random(3)
    expected, t = [], 0.0
    for _ in range(6):
        expected.append(t)
        t += rng.expovariate(rate)
    assert r["rate"] == rate and r["requests"] == 6 and r["output_tokens"] == 6 * w.output_lens[0]
    # no request leaves before its arrival time (5 ms for clock granularity); all of them do leave
    assert all(s >= e - 0.005 for s, e in zip(sorted(sent_at), expected))


def test_rates_must_be_positive():
    from bench import serve

    with pytest.raises(SystemExit):
        serve.main(["--rates", "0"])


def test_a_burst_spread_over_client_processes_sends_every_request_once(monkeypatch):
    """One Python client process tops out below what the server streams; the burst is split round robin over
    several processes that start together, and their figures are merged."""
    async def fake_stream_one(client, url, prompt, max_tokens):
        return {"ttft": 0.01, "itl": [0.01], "tokens": max_tokens, "chunks": 2, "tpot": 0.01, "latency": 0.02,
                "prompt": tuple(prompt)}

    monkeypatch.setattr(worker, "stream_completion", fake_stream_one)
    w = worker.serve_workload(SIZES["cpu", True], 49152, 7, seed=2)
    r = worker._run_burst("http://fake", w, 3)
    assert r["client_processes"] == 3 and r["requests"] == 7 and r["wrong_lengths"] == 0
    assert r["output_tokens"] == sum(w.output_lens) and len(r["ttft_s"]) == 7


@pytest.mark.parametrize("processes", [1, 3])
def test_warm_connections_open_before_the_clock_starts(monkeypatch, processes):
    """With `warm_connections` each client process opens one connection per stream it runs before its clock starts
    (so the burst's time holds no connection set-up); without it, none is opened beforehand."""
    import multiprocessing as mp
    import time

    opened = mp.get_context("fork").Queue()

    class FakeClient:
        async def open_connections(self, url, count):
            opened.put((count, time.perf_counter()))

    @contextlib.asynccontextmanager
    async def fake_open_client(kind, connections):
        yield FakeClient()

    async def fake_stream_one(client, url, prompt, max_tokens):
        await asyncio.sleep(0.01)
        return {"ttft": 0.01, "itl": [], "tokens": max_tokens, "chunks": 1, "tpot": None, "latency": 0.01}

    monkeypatch.setattr(worker, "open_client", fake_open_client)
    monkeypatch.setattr(worker, "stream_completion", fake_stream_one)
    w = worker.serve_workload(SIZES["cpu", True], 49152, 7, seed=2)
    cold = worker._run_burst("http://fake", w, processes)
    assert cold["requests"] == 7 and opened.empty()
    warm = worker._run_burst("http://fake", w, processes, warm_connections=True)
    calls = [opened.get(timeout=10) for _ in range(processes)]
    assert warm["requests"] == 7 and opened.empty()
    assert sorted(count for count, _ in calls) == sorted(len(w.prompts[i::processes]) for i in range(processes))
    assert all(at < warm["clock_s"][0] for _, at in calls)


@pytest.mark.parametrize(("stage", "http_client"), [("stage3_served", "httpx"), ("stage4_fast", "aiohttp")])
def test_serve_path_runs_the_real_server_with_the_stub_scheduler(stage, http_client, tmp_path):
    """`python -m bench serve-path` starts the stage's server with its scheduler entry replaced by a stub: the stub
    must keep to the launcher's start-up protocol (worker setup, the scheduler's acknowledgement), which the stage's
    own entry defines, so a change there shows here and not on the next measurement. Each of the two client
    libraries reads a real server's streams here (every token counted, the usage chunk read)."""
    import json
    import subprocess

    models = REPO / "models"
    if not (models / "tiny-qwen3" / "config.json").exists():
        subprocess.run([sys.executable, "-m", "models", "make", "tiny-qwen3"], cwd=REPO, check=True)
    out = tmp_path / "serve_path.json"
    run = subprocess.run([sys.executable, "-m", "bench", "serve-path", "--stage", stage, "--requests", "4",
                          "--output-len", "6", "--prompt-len", "8", "16", "--http-client", http_client,
                          "--model", str(models / "tiny-qwen3"),
                          "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["output_tokens"] == 24 and res["wrong_lengths"] == 0
    assert set(res["cpu_us_per_token"]) == {f"clients ({http_client})", "api server", "scheduler_0",
                                            "tokenizer+detokenizer"}
    assert res["http_client"] == http_client
    assert res["served_model"] == "tiny-qwen3"  # the model asked for, not the server's default


def test_the_burst_finds_the_server_processes_by_role():
    """The served burst reports how busy each process of the server it launched was: the API server is that
    process, its workers go by their process titles; a child without a title is none of them."""
    import os
    import signal
    import subprocess
    import time

    titled = "import setproctitle, time; setproctitle.setproctitle('minisgl::scheduler_0'); time.sleep(30)"
    server = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {titled!r}]); "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)")
    api = subprocess.Popen([sys.executable, "-c", server], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while set(worker.server_processes(api.pid)) != {"scheduler_0", "api server"} and time.monotonic() < deadline:
            time.sleep(0.1)
        roles = worker.server_processes(api.pid)
        assert set(roles) == {"scheduler_0", "api server"} and roles["api server"].pid == api.pid
        assert roles["scheduler_0"].cmdline()[0] == "minisgl::scheduler_0"
        assert all(t >= 0 for t in worker.cpu_seconds(roles).values())
        assert worker.server_processes(None) == {}  # a server the benchmark did not launch (a test's fake)
    finally:
        os.killpg(api.pid, signal.SIGKILL)
        api.wait()
