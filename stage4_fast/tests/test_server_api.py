"""The production API through the official `openai` client, on the tiny Qwen3 server: n samples sharing one
prefill and reproducible with a seed, several prompts per request, penalties / logit bias / min-p against HF
with the reference formulas, echo with logprobs when the prompt is cached, streamed choices, and a grammar that
holds even a random model to its schema."""

from __future__ import annotations

import json
import re
from typing import List

import httpx
import openai
import pytest

from stage4_fast.core import SamplingParams

from .api_reference import hf_greedy_with_penalties, hf_logprobs

PROMPT = [(41 * i + 3) % 5000 + 200 for i in range(70)]  # token ids: the tiny model shares SmolLM2's vocabulary


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def complete(client, tiny_dir):
    def run(prompt, **kwargs):
        kwargs.setdefault("max_tokens", 8)
        return client.completions.create(model=str(tiny_dir), prompt=prompt, **kwargs)

    return run


def _prefill_tokens(server) -> int:
    return httpx.get(f"{server.base_url}/v1/stats", timeout=30).json()["scheduler"]["prefill_tokens"]


def test_n_samples_share_one_prefill_and_a_seed_reproduces_them(complete, tiny_server):
    prompt = [t + 1 for t in PROMPT]  # not cached by another test
    before = _prefill_tokens(tiny_server)
    r = complete(prompt, n=4, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    computed = _prefill_tokens(tiny_server) - before
    # the first sample computes the prompt; the others take it from the radix cache and compute only what
    # is past its last full page (page size 4), the last token included
    assert len(prompt) <= computed <= len(prompt) + 3 * 4, computed
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and len(set(texts)) == 4  # seed + j: distinct samples
    again = complete(prompt, n=4, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == texts
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 4 * 8


def test_several_prompts_times_n_come_in_order(complete):
    prompts = [PROMPT[:20], PROMPT[20:45]]
    r = complete(prompts, n=2, temperature=0, extra_body={"ignore_eos": True})
    singles = [complete(p, temperature=0, extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.prompt_tokens == 45


def test_streamed_choices_reassemble_to_the_plain_ones(complete):
    kwargs = dict(n=3, temperature=0.9, seed=7, logprobs=2, extra_body={"ignore_eos": True})
    plain = complete(PROMPT[:30], **kwargs)
    texts, logprobs = ["", "", ""], [[], [], []]
    for chunk in complete(PROMPT[:30], stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
            logprobs[c.index] += c.logprobs.token_logprobs if c.logprobs else []
    assert texts == [c.text for c in plain.choices]
    for got, c in zip(logprobs, plain.choices):
        assert got == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)


@pytest.mark.parametrize("params", [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=0.7),
    SamplingParams(logit_bias=[(PROMPT[0], 5.0), (PROMPT[1], -100.0)]),
], ids=["presence", "frequency", "repetition", "all three", "logit_bias"])
def test_greedy_with_penalties_equals_hf_with_the_reference_formula(complete, tiny_dir, params):
    prompt = PROMPT[:12]
    r = complete(prompt, max_tokens=10, temperature=0, presence_penalty=params.presence_penalty,
                  frequency_penalty=params.frequency_penalty,
                  logit_bias={str(t): b for t, b in params.logit_bias} or None, logprobs=0,
                  extra_body={"ignore_eos": True, "repetition_penalty": params.repetition_penalty})
    expected = hf_greedy_with_penalties(tiny_dir, prompt, 10, params)
    # the output's token ids, through their logprob-by-position (each output token is the argmax we expect)
    reference = hf_logprobs(tiny_dir, prompt + expected)
    got = r.choices[0].logprobs.token_logprobs
    assert got == pytest.approx([reference[len(prompt) - 1 + i, t].item() for i, t in enumerate(expected)],
                                abs=1e-4)


def test_logit_bias_forces_a_token(complete):
    r = complete(PROMPT[:10], max_tokens=5, temperature=0.8, seed=3, logit_bias={"1234": 100},
                  extra_body={"ignore_eos": True}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [r.choices[0].logprobs.tokens[0]] * 5  # token 1234 every time


def test_min_p_one_keeps_only_the_likeliest_token(complete):
    greedy = complete(PROMPT[:10], temperature=0, extra_body={"ignore_eos": True})
    sampled = complete(PROMPT[:10], temperature=1.5, seed=11, extra_body={"ignore_eos": True, "min_p": 1.0})
    assert sampled.choices[0].text == greedy.choices[0].text


def _echo_logprobs(complete, prompt: List[int]) -> List[float | None]:
    # what lm-eval's local-completions sends for a loglikelihood request
    r = complete(prompt, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.top_logprobs[0] is None
    assert r.choices[0].text.startswith("".join(lp.tokens[: len(prompt)]))
    return lp.token_logprobs


def test_echo_logprobs_equal_hf_also_for_a_cached_prompt(complete, tiny_server, tiny_dir):
    prompt = [t + 2 for t in PROMPT]
    complete(prompt, max_tokens=2, temperature=0)  # now the prompt is in the radix cache
    before = _prefill_tokens(tiny_server)
    first = _echo_logprobs(complete, prompt)
    assert _prefill_tokens(tiny_server) - before == len(prompt)  # echo recomputes the whole prompt
    second = _echo_logprobs(complete, prompt)
    reference = hf_logprobs(tiny_dir, prompt)
    expected = [None] + [reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    for got in (first, second):
        assert got[0] is None
        assert got[1 : len(prompt)] == pytest.approx(expected[1:], abs=1e-4)


def test_a_schema_holds_every_sample_of_a_random_model(client, tiny_dir):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "required": ["color", "ok", "size"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]}}}
    r = client.chat.completions.create(
        model=str(tiny_dir), messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=1.0, seed=5,
        n=3, response_format={"type": "json_schema", "json_schema": {"name": "shirt", "schema": schema}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("extra, holds", [
    ({"regex": "(ab|cd)[0-9]{3}"}, lambda text: re.fullmatch("(ab|cd)[0-9]{3}", text)),
    ({"structured_outputs": {"choice": ["north", "south", "east", "west"]}},
     lambda text: text in ("north", "south", "east", "west")),
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": "[0-9]{3}"}, "end": "</n>"}})}},
     lambda text: re.fullmatch("<n>[0-9]{3}</n>", text)),
], ids=["regex", "choice", "structural_tag"])
def test_a_regex_or_a_choice_holds_every_sample_of_a_random_model(client, tiny_dir, extra, holds):
    r = client.chat.completions.create(model=str(tiny_dir), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=20, temperature=1.0, seed=5, n=3, extra_body=extra)
    for choice in r.choices:
        assert choice.finish_reason == "stop" and holds(choice.message.content), choice.message.content


def test_json_holds_free_whitespace_only_when_a_request_allows_it(client, tiny_dir):
    """vLLM's structured_outputs.disable_any_whitespace: false lets the JSON hold newlines (a logit bias pushes the
    random model to them); true, or nothing, keeps them out (this server's default)."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    [brace], [newline] = (tokenizer.encode(text, add_special_tokens=False) for text in ("{", "\n"))
    texts = {}
    for disable in (None, True, False):  # "{" first, then a newline wherever the grammar lets one in
        r = client.chat.completions.create(
            model=str(tiny_dir), messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
            logit_bias={str(brace): 100, str(newline): 50},
            extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": disable}})
        texts[disable] = r.choices[0].message.content
    assert "\n" not in texts[None] + texts[True] and "\n" in texts[False], texts


def test_a_structural_tag_response_format_holds_what_follows_a_trigger(client, tiny_dir):
    """SGLang's and vLLM's response_format structural_tag: free text until a trigger, then the structure's begin,
    JSON held to its schema and its end. The random model is pushed to the trigger by a logit bias."""
    tag = {"type": "structural_tag", "triggers": ["<"],
           "structures": [{"begin": "<w>", "schema": {"enum": ["yes", "no"]}, "end": "</w>"}]}
    from transformers import AutoTokenizer

    [lt] = AutoTokenizer.from_pretrained(tiny_dir).encode("<", add_special_tokens=False)
    r = client.chat.completions.create(model=str(tiny_dir), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=12, temperature=0, logit_bias={str(lt): 100}, response_format=tag)
    assert re.match(r'<w>\s*"(yes|no)"\s*</w>', r.choices[0].message.content), r.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="starts with none of the triggers"):
        client.chat.completions.create(model=str(tiny_dir), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, response_format={**tag, "triggers": ["["]})


def test_the_token_that_ends_a_request_has_its_logprob(complete, tiny_dir):
    """The stop token is not in the text but is in the logprobs (as vLLM): lm-eval's loglikelihood reads one
    entry per prompt token plus one per generated token, and drops the last."""
    prompt = PROMPT[:10]
    first = int(hf_logprobs(tiny_dir, prompt)[-1].argmax())
    r = complete(prompt, max_tokens=4, temperature=0, logprobs=1, echo=True, extra_body={"stop_token_ids": [first]})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == 1
    assert len(choice.logprobs.token_logprobs) == len(prompt) + 1
    assert choice.text == "".join(choice.logprobs.tokens[: len(prompt)])  # the stop token's text is not shown


def test_chat_template_options_shape_the_prompt_as_transformers_renders_it(client, tiny_dir):
    """continue_final_message leaves the assistant's message open, add_generation_prompt false leaves the header
    out, and chat_template_kwargs reach the template (vLLM's and SGLang's fields): the prompt's token count is
    that of transformers' rendering with the same options."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    messages = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Bonjour, je"}]

    def prompt_tokens(**extra) -> int:
        r = client.chat.completions.create(model=str(tiny_dir), messages=messages, max_tokens=2, temperature=0,
                                           extra_body=extra)
        return r.usage.prompt_tokens

    def hf(**kwargs) -> int:
        return len(tok.encode(tok.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False))

    assert prompt_tokens() == hf(add_generation_prompt=True)
    assert prompt_tokens(continue_final_message=True) == hf(continue_final_message=True)
    assert prompt_tokens(add_generation_prompt=False) == hf(add_generation_prompt=False)
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == hf(add_generation_prompt=True)
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        prompt_tokens(add_generation_prompt=True, continue_final_message=True)


def test_min_tokens_lets_no_stop_string_end_in_the_text_of_the_first_tokens(complete):
    """vLLM's rule: a stop string counts once it ends in text after the first min_tokens tokens (it may start
    before). Greedy, so every request writes the same text; the stop string is a character that the output has in
    an early token and again after min_tokens tokens."""
    run = dict(max_tokens=40, temperature=0)
    full = complete(PROMPT, **run, logprobs=0, extra_body={"ignore_eos": True}).choices[0]
    text, starts = full.text, full.logprobs.text_offset
    owner = {i: k for k, (a, b) in enumerate(zip(starts, [*starts[1:], len(text)])) for i in range(a, b)}
    found = [(c, sorted({owner[i] for i, x in enumerate(text) if x == c})) for c in sorted(set(text))
             if c.isascii() and c.isprintable()]
    char, tokens = next((c, k) for c, k in found if len(k) >= 2 and k[0] < k[-1] - 1)
    first, later = tokens[0], next(k for k in tokens if k > tokens[0] + 1)
    plain = complete(PROMPT, **run, stop=[char], extra_body={"ignore_eos": True}).choices[0]
    assert plain.text == text[: text.index(char)] and plain.finish_reason == "stop"
    for stream in (False, True):
        r = complete(PROMPT, **run, stop=[char], stream=stream,
                     extra_body={"ignore_eos": True, "min_tokens": first + 1})
        out = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert out == text[: text.index(char, starts[first + 1])], (char, first, later)
        assert len(out) >= starts[later] > starts[first]


def test_min_tokens_keeps_eos_back_until_the_output_is_that_long(complete, tiny_dir):
    """With EOS made the likeliest token (logit_bias), greedy decoding ends at once; min_tokens (vLLM's field)
    holds it back for that many tokens, after which it ends the request."""
    from transformers import AutoConfig

    eos = AutoConfig.from_pretrained(str(tiny_dir)).eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    push = {str(eos): 100}
    assert complete(PROMPT, max_tokens=20, temperature=0, logit_bias=push).usage.completion_tokens == 1
    r = complete(PROMPT, max_tokens=20, temperature=0, logit_bias=push, extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"
    # stop ids no token has (beyond the vocabulary, negative) are held back as nothing: the request runs
    r = complete(PROMPT, max_tokens=3, extra_body={"min_tokens": 2, "stop_token_ids": [2**31 - 1, -5]})
    assert r.usage.completion_tokens == 3 and complete(PROMPT, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, tiny_dir, chat):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries its choice's usage so far; with
    include_usage the last chunk is the total, as without."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=str(tiny_dir), max_tokens=6, temperature=0, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Count"}], **kwargs))
    else:
        chunks = list(client.completions.create(prompt=PROMPT[:20], **kwargs))
    *running, total = chunks
    assert total.choices == [] and total.usage.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in running]
    assert all(c.usage is not None and c.usage.prompt_tokens == total.usage.prompt_tokens for c in running)
    assert counts == sorted(counts) and counts[-1] == 6 and (counts[0] == 0) == chat  # a chat's role chunk: 0
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in running)


def test_template_variables_that_spell_the_codecs_markers_stay_plain_variables(client, tiny_dir):
    """chat_template_kwargs' keys are the client's: one spelling the IPC codec's type marker must reach the
    template as a variable (the codec wraps such a dict), not build a message in the tokenizer worker."""
    for kwargs in ({"__type__": "Tensor"}, {"x": {"__type__": "AbortMsg", "uid": 1}}, {"__type__": "__columns__"}):
        r = client.chat.completions.create(model=str(tiny_dir), messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={"chat_template_kwargs": kwargs})
        assert r.usage.completion_tokens == 2
