"""The official `openai` client against the real server on SmolLM2: greedy text equals the offline LLM and HF,
usage is right, stop strings and stop token ids cut where they should, streaming and not; stage 4's logprobs
equal log_softmax of HF's logits and its response_format outputs validate against their schemas."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stage4_fast.core import SamplingParams
from stage4_fast.harness import server_process

from .api_reference import hf_logprobs

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
N = 24


@pytest.fixture(scope="module")
def model_id(smollm2_dir: Path) -> str:
    return smollm2_dir.name  # the server names its model after the model directory, as SGLang does


@pytest.fixture(scope="module")
def server(smollm2_dir: Path):
    with server_process(str(smollm2_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def chat_ids(tok) -> list[int]:
    rendered = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


@pytest.fixture(scope="module")
def references(smollm2_dir, tok, chat_ids):
    """Greedy continuations of the raw prompt (EOS ignored) and of the chat (stopping at EOS), from the offline
    LLM and from HF transformers."""
    from stage4_fast.llm import LLM

    raw_ids = tok(PROMPT).input_ids
    llm = LLM(str(smollm2_dir), dtype=torch.float32)
    raw_params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=N)
    chat_params = SamplingParams(temperature=0.0, max_tokens=64)
    raw_llm, chat_llm = llm.generate([PROMPT, chat_ids], [raw_params, chat_params], use_tqdm=False)
    del llm
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        raw_hf = hf.generate(torch.tensor([raw_ids]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(raw_ids):].tolist()
        chat_hf = hf.generate(torch.tensor([chat_ids]), max_new_tokens=64, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=0)[0, len(chat_ids):].tolist()
    assert raw_llm["token_ids"] == raw_hf
    eos_hit = chat_hf[-1] == tok.eos_token_id
    assert chat_llm["token_ids"] == (chat_hf[:-1] if eos_hit else chat_hf)
    return {"raw": raw_llm, "chat": chat_llm, "chat_eos": eos_hit, "raw_ids": raw_ids}


def test_completion_equals_offline_and_hf(client, model_id, references, tok):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=N,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == references["raw"]["text"] == tok.decode(references["raw"]["token_ids"])
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(references["raw_ids"])
    assert r.usage.completion_tokens == N and r.usage.total_tokens == N + len(references["raw_ids"])
    assert r.object == "text_completion"


def test_streamed_completion_equals_the_plain_one(client, model_id, references):
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == references["raw"]["text"]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_equals_offline_and_hf_with_usage(client, model_id, references, chat_ids):
    r = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=64, temperature=0)
    chat = references["chat"]
    assert "Paris" in chat["text"]
    assert r.choices[0].message.content == chat["text"] and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if references["chat_eos"] else "length")
    assert r.usage.prompt_tokens == len(chat_ids)
    assert r.usage.completion_tokens == len(chat["token_ids"]) + references["chat_eos"]  # EOS counts, unshown
    assert r.object == "chat.completion"


def test_streamed_chat_follows_the_openai_chunk_format(client, model_id, references):
    chunks = list(client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=64, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens > 0
    body = chunks[:-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == references["chat"]["text"]
    assert body[-1].choices[0].finish_reason == ("stop" if references["chat_eos"] else "length")
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_special_tokens_are_hidden_unless_asked_for(client, model_id, references, chat_ids, tok, endpoint, stream):
    """Told to ignore EOS, the model writes <|im_end|> after its answer: the text leaves it out by default, as vLLM's
    and SGLang's (skip_special_tokens=true), and shows it with skip_special_tokens=false."""
    assert references["chat_eos"]  # the answer ends in EOS, <|im_end|>
    answer = references["chat"]["text"]
    n = len(references["chat"]["token_ids"]) + 2  # the answer, <|im_end|> and one token more

    def text(**extra) -> str:
        body = {"ignore_eos": True, **extra}
        if endpoint == "chat":
            out = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=n, temperature=0,
                                                 stream=stream, extra_body=body)
            return "".join(c.choices[0].delta.content or "" for c in out) if stream else out.choices[0].message.content
        out = client.completions.create(model=model_id, prompt=chat_ids, max_tokens=n, temperature=0, stream=stream,
                                        extra_body=body)
        return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text

    shown, hidden = text(skip_special_tokens=False), text()
    assert shown.startswith(answer + "<|im_end|>")
    specials = tok.convert_ids_to_tokens(list(tok.added_tokens_decoder))
    assert hidden == functools.reduce(lambda s, special: s.replace(special, ""), specials, shown)
    assert hidden.startswith(answer) and "<|" not in hidden
    assert text(skip_special_tokens=True) == hidden


def test_raw_sse_ends_with_done(server):
    body = {"messages": QUESTION, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


@pytest.mark.parametrize("keep", [False, True], ids=["cut", "include_stop_str_in_output"])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, model_id, references, stream, keep):
    full = references["raw"]["text"]
    words = full.split()
    stop = words[len(words) // 2][:3]  # a stop string from the middle of the greedy answer
    want = full[: full.index(stop) + (len(stop) if keep else 0)]
    kwargs = dict(model=model_id, prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop, "never-ever-here"],
                  extra_body={"ignore_eos": True, "include_stop_str_in_output": keep})
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kwargs)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == want and finish == "stop"


def test_stop_token_id_ends_the_request(client, model_id, references, tok):
    ids = references["raw"]["token_ids"]
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=N, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [ids[5]]})
    first = ids.index(ids[5])
    assert r.choices[0].text == tok.decode(ids[:first]) and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == first + 1


def test_seed_makes_sampling_reproducible(client, model_id):
    def sample(seed: int) -> str:
        r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95,
                                      seed=seed, extra_body={"ignore_eos": True, "top_k": 50})
        return r.choices[0].text

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b and a != c


def test_models_and_health(client, model_id, server, smollm2_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id] and models[0].owned_by == "mini-sglang"
    for name in (model_id, str(smollm2_dir)):  # the id or the path given to --model
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=1)
        assert r.model == model_id
    assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ok"}


def test_upstream_generate_endpoint(server, references):
    body = {"prompt": PROMPT, "max_tokens": N, "ignore_eos": True, "stream": False}
    r = httpx.post(f"{server.base_url}/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["text"] == references["raw"]["text"]


# ---- the production API (stage 4): logprobs and response_format on the real model ---------------------------------

K = 5  # alternatives asked per position
LP_TOKENS = 8  # tokens whose logprobs are checked


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_hf(client, model_id, references, smollm2_dir, tok, stream):
    ids = references["raw"]["token_ids"][:LP_TOKENS]
    kwargs = dict(model=model_id, prompt=PROMPT, max_tokens=LP_TOKENS, temperature=0, logprobs=K,
                  extra_body={"ignore_eos": True})
    if stream:
        tokens, values, tops = [], [], []
        for c in client.completions.create(stream=True, **kwargs):
            lp = c.choices[0].logprobs
            if lp is not None:
                tokens, values, tops = tokens + lp.tokens, values + lp.token_logprobs, tops + lp.top_logprobs
    else:
        lp = client.completions.create(**kwargs).choices[0].logprobs
        tokens, values, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
        assert lp.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    reference = hf_logprobs(smollm2_dir, references["raw_ids"] + ids)
    start = len(references["raw_ids"]) - 1
    assert tokens == [tok.decode([t]) for t in ids]
    assert values == pytest.approx([reference[start + i, t].item() for i, t in enumerate(ids)], abs=1e-4)
    for i, top in enumerate(tops):
        best = reference[start + i].topk(K)
        assert list(top) == [tok.decode([t]) for t in best.indices.tolist()]
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_hf(client, model_id, references, smollm2_dir, chat_ids, tok, stream):
    # the EOS that ends the answer is not in its text but has its logprob entry (as vLLM)
    ids = (references["chat"]["token_ids"] + [tok.eos_token_id] * references["chat_eos"])[:LP_TOKENS]
    kwargs = dict(model=model_id, messages=QUESTION, max_tokens=LP_TOKENS, temperature=0, logprobs=True,
                  top_logprobs=K)
    if stream:
        content = [e for c in client.chat.completions.create(stream=True, **kwargs)
                   if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    reference = hf_logprobs(smollm2_dir, chat_ids + ids)
    start = len(chat_ids) - 1
    assert [e.token for e in content] == [tok.decode([t]) for t in ids]
    assert [e.bytes for e in content] == [list(tok.decode([t]).encode()) for t in ids]
    assert [e.logprob for e in content] == pytest.approx([reference[start + i, t].item() for i, t in enumerate(ids)],
                                                         abs=1e-4)
    for i, e in enumerate(content):
        best = reference[start + i].topk(K)
        assert [a.token for a in e.top_logprobs] == [tok.decode([t]) for t in best.indices.tolist()]
        assert [a.logprob for a in e.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_echo_with_logprobs_returns_the_prompt(client, model_id, references, smollm2_dir):
    prompt_ids = references["raw_ids"]
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                  echo=True)
    choice = r.choices[0]
    assert choice.text == PROMPT + references["raw"]["text"][: len(choice.text) - len(PROMPT)]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(prompt_ids) + 2
    reference = hf_logprobs(smollm2_dir, prompt_ids)
    expected = [reference[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))]
    assert lp.token_logprobs[1 : len(prompt_ids)] == pytest.approx(expected, abs=1e-4)


# schemas of every kind the JSON grammar handles: nested objects, enums and booleans, arrays, numbers
SCHEMAS = {
    "nested": {"type": "object", "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 24},
        "address": {"type": "object", "required": ["city", "zip"], "properties": {
            "city": {"type": "string", "maxLength": 24}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}}},
    }},
    "enum": {"type": "object", "required": ["color", "ok"],
             "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
    "array": {"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}}},
    "numbers": {"type": "object", "required": ["x", "n"], "properties": {
        "x": {"type": "number", "minimum": -1000, "maximum": 1000}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 100}}},
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_output_parses_and_validates(client, model_id, name):
    jsonschema = pytest.importorskip("jsonschema")
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": f"Reply with a JSON object ({name})."}],
        max_tokens=80, temperature=0, response_format={"type": "json_schema",
                                                       "json_schema": {"name": name, "schema": schema}})
    assert r.choices[0].finish_reason == "stop"  # the grammar completed and allowed only EOS
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_output_is_a_json_object(client, model_id):
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=80,
        temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, holds", [
    ({"regex": r"[A-Z][a-z]+, [0-9]{4}"}, lambda text: re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", text)),  # SGLang's
    ({"ebnf": 'root ::= "The answer is " ("yes" | "no") "."'},
     lambda text: text in ("The answer is yes.", "The answer is no.")),
    ({"json_schema": json.dumps(SCHEMAS["enum"])}, lambda text: _valid(text, SCHEMAS["enum"])),
    ({"structured_outputs": {"choice": ["Paris", "Lyon", "Marseille"]}},  # vLLM's
     lambda text: text in ("Paris", "Lyon", "Marseille")),
    ({"structured_outputs": {"regex": r"[0-9]{2}:[0-9]{2}"}}, lambda text: re.fullmatch(r"[0-9]{2}:[0-9]{2}", text)),
    ({"structured_outputs": {"grammar": 'root ::= ("red" | "blue") " " [0-9] [0-9]'}},
     lambda text: re.fullmatch(r"(red|blue) [0-9]{2}", text)),
    ({"structured_outputs": {"json": SCHEMAS["array"]}}, lambda text: _valid(text, SCHEMAS["array"])),
], ids=["regex", "ebnf", "json_schema", "vllm-choice", "vllm-regex", "vllm-grammar", "vllm-json"])
def test_structured_output_fields_hold_the_output(client, model_id, extra, holds):
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=40,
        temperature=0, extra_body=extra)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and holds(text), text


def _valid(text: str, schema: dict) -> bool:
    pytest.importorskip("jsonschema").validate(json.loads(text), schema)
    return True


def test_unsupported_schema_is_a_400(client, model_id):
    with pytest.raises(openai.BadRequestError, match="unsupported JSON schema"):
        client.chat.completions.create(
            model=model_id, messages=QUESTION, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "tensor"}}})
