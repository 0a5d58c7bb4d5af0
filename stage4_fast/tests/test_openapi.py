"""The OpenAPI document tells the truth about the server: schemathesis, with every one of its checks, against a live
tiny server. Statuses (400/401/404/413/503, no 422), `text/event-stream` for streams, the validators' constraints
(`{"prompt": ""}` is invalid in the schema too), 405 with `Allow`, bounds known at start-up (context, vocabulary).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from stage4_fast.harness import ServerProcess
from stage4_fast.server.api_server import BackendInfo, create_app
from stage4_fast.server.args import ServerArgs

REPO = Path(__file__).resolve().parents[2]
# ~900 requests, ~250 of them generating one token: schemathesis' coverage phase (the boundaries of every field,
# every method) plus 5 fuzzed cases per operation; 4 clients at a time, so the server batches the generations.
# About 50 s on two busy cores.
MAX_EXAMPLES = 5
WORKERS = 4


def test_schemathesis_finds_the_document_true(tiny_server: ServerProcess, tiny_dir: Path, tmp_path: Path):
    context = httpx.get(f"{tiny_server.base_url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    vocab = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    env = dict(os.environ, PYTHONPATH=str(REPO), SCHEMATHESIS_HOOKS="stage4_fast.tests.schemathesis_hooks",
               MINISGL_TEST_CONTEXT_LENGTH=str(context), MINISGL_TEST_VOCAB_SIZE=str(vocab), NO_COLOR="1")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{tiny_server.base_url}/openapi.json", "--checks", "all",
           "--phases", "coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES), "--seed", "1",
           "--request-timeout", "60", "--workers", str(WORKERS), "--output-sanitize", "false"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]


def _document(api_key: str | None) -> dict:
    config = ServerArgs(model_path=str(REPO / "models" / "tiny-qwen3"), api_key=api_key)
    return create_app(config, BackendInfo(max_seq_len=4096, num_pages=16, page_size=1, vocab_size=1000)).openapi()


def test_document_names_auth_and_run_time_bounds():
    doc = _document("secret")
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc["paths"].items():
        for operation in item.values():
            assert "422" not in operation["responses"]
            assert ("401" in operation["responses"]) == (path != "/health")
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == 4096
    token_id = completion["prompt"]["oneOf"][1]["items"]
    assert (token_id["minimum"], token_id["maximum"]) == (0, 999)
    assert "401" not in _document(None)["paths"]["/v1/models"]["get"]["responses"]
