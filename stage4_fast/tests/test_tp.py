"""Tensor parallelism over gloo with real processes: the collectives, every TP layer kind against the unsharded
computation (TP 2 and 4: KV-head replication, a vocabulary that 4 does not divide, expert TP), and the server with
one scheduler process per rank. (HF alignment of whole TP engines is the shared suite's `tp` case.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch

from stage4_fast.harness import server_process

from .conftest import REPO, prepared_model
from .fast_helpers import hf_generate
from .tp_workers import reference_layers, spawn, tp_layers


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"tp{n}")
def ranks(request):
    """Every rank's outputs of `tp_workers.tp_layers` (one spawn per TP size)."""
    return request.param, spawn(tp_layers, request.param)


def test_all_reduce_sums_and_all_gather_is_rank_major(ranks):
    size, results = ranks
    for r in results:
        assert torch.equal(r["reduced"], torch.full((2, 3), float(sum(range(1, size + 1)))))
        assert r["gathered"].view(-1).tolist() == [float(10 * rank + i) for rank in range(size) for i in range(2)]


def test_tp_layers_equal_the_unsharded_computation(ranks):
    size, results = ranks
    ref = reference_layers(results[0])
    head_dim, num_q, num_kv = 4, 4, 2
    q_local, kv_local = num_q // size, max(1, num_kv // size)
    for rank, out in enumerate(results):
        for name in ("o_proj", "o_proj_add", "mlp", "embed", "lm_head", "moe"):
            torch.testing.assert_close(out[name], ref[name], atol=1e-5, rtol=1e-5, msg=f"{name} rank {rank}")
        q, k, v = out["qkv"].split([q_local * head_dim, kv_local * head_dim, kv_local * head_dim], dim=-1)
        kv_head = rank * num_kv // size  # with more ranks than KV heads, rank r holds head r * kv // tp
        torch.testing.assert_close(q, ref["q"].view(5, num_q, head_dim)[:, rank * q_local:][:, :q_local].reshape(5, -1))
        torch.testing.assert_close(k, ref["k"].view(5, num_kv, head_dim)[:, kv_head:][:, :kv_local].reshape(5, -1))
        torch.testing.assert_close(v, ref["v"].view(5, num_kv, head_dim)[:, kv_head:][:, :kv_local].reshape(5, -1))


def test_server_with_two_ranks_matches_hf():
    """`python -m stage4_fast --tp 2`: two scheduler processes (rank 0 broadcasts each step's messages), gloo."""
    path = prepared_model("tiny-qwen3")
    from transformers import AutoTokenizer

    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    want = AutoTokenizer.from_pretrained(path).decode(hf_generate(path, [prompt], 8)[0])
    with server_process(str(path), tp=2, num_pages=256) as server:
        body = json.dumps({"model": str(path), "prompt": prompt, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{server.base_url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
        assert "rank 1/2" in server.log()  # the second rank's engine started in its own process
    assert text == want


def test_tp_that_does_not_split_the_heads_is_a_cli_error(capsys):
    """SmolLM2 has 9 query heads: `--tp 2` must stop with a readable message, not an assertion in a rank."""
    from stage4_fast.server.args import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", str(prepared_model("smollm2")), "--tp", "2"])
    assert exc.value.code == 2
    assert "--tp 2: the model's 9 attention heads do not split evenly over 2 ranks" in capsys.readouterr().err


def test_offline_tp_that_does_not_split_the_heads_is_a_value_error():
    from stage4_fast import LLM

    with pytest.raises(ValueError, match="tp=2: the model's 9 attention heads do not split evenly over 2 ranks"):
        LLM(str(prepared_model("smollm2")), tp=2)


def test_offline_tp_in_a_script_without_the_main_guard_fails_at_once_naming_the_guard(tmp_path):
    """The spawned rank re-imports the script, whose module-level LLM(tp=2) kills that rank; rank 0 must say so
    instead of waiting out the process-group timeout (set far beyond the subprocess timeout here)."""
    script = tmp_path / "offline_tp.py"
    script.write_text(
        "from stage4_fast import LLM, SamplingParams\n\n"
        f"llm = LLM({str(prepared_model('tiny-qwen3'))!r}, tp=2, distributed_timeout=600)\n"
        "print(llm.generate(['Hi'], SamplingParams(max_tokens=2))[0]['text'])\n"
        "llm.shutdown()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert "TP rank 1 exited with code 1 before it started" in last_line
    assert 'under `if __name__ == "__main__":`' in last_line
