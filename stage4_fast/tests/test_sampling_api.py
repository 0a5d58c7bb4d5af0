"""The production API's sampling fields against reference formulas (vLLM's semantics): penalties, logit bias, min-p
batched in the sampler, and logprobs (also of an echoed prompt) equal to log_softmax of HF's logits."""

from __future__ import annotations

import json
import math
from typing import List

import pytest
import torch

from stage4_fast.core import Batch, Req, SamplingParams
from stage4_fast.engine import Sampler
from stage4_fast.sampling import apply_logit_bias, apply_min_p, apply_penalties

from .api_reference import hf_logprobs, reference_penalties

VOCAB = 50


def _decode_req(row: int, prompt: List[int], num_out: int, params: SamplingParams) -> Req:
    """A request about to sample its (num_out + 1)-th token: its prompt and num_out outputs have KV. Only the
    prompt is on the host: the sampler must read the outputs from the token pool (with overlap scheduling the
    host learns the last one a step late)."""
    req = Req(torch.tensor(prompt, dtype=torch.int32), row, 0, 16, row, params)
    req.device_len = len(prompt) + num_out
    req.cached_len = req.device_len - 1
    return req


def test_penalties_match_the_reference_formula_and_read_the_token_pool():
    gen = torch.Generator().manual_seed(0)
    cases = [  # (prompt, output so far, params)
        ([3, 4, 5, 3], [7, 7, 4, 9, 7], SamplingParams(presence_penalty=0.5, frequency_penalty=0.3)),
        ([1, 2], [2, 2, 8], SamplingParams(repetition_penalty=1.7)),
        ([10, 11, 12], [], SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0)),  # first token
        ([6], [6, 20, 21, 20], SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=1.3)),
        ([30, 31], [32], SamplingParams()),  # no penalty: its row is left alone
    ]
    token_pool = torch.zeros(len(cases), 64, dtype=torch.int32)
    reqs = []
    for row, (prompt, output, params) in enumerate(cases):
        token_pool[row, : len(prompt) + len(output)] = torch.tensor(prompt + output)
        reqs.append(_decode_req(row, prompt, len(output), params))
    logits = torch.randn(len(cases), VOCAB, generator=gen) * 3
    sampler = Sampler(torch.device("cpu"), VOCAB)
    args = sampler.prepare(Batch(reqs, "decode"), token_pool)
    assert args.penalties is not None and args.penalties.rows.tolist() == [0, 1, 2, 3]
    processed = logits.clone()
    apply_penalties(processed, token_pool, args.penalties)
    for row, (prompt, output, params) in enumerate(cases):
        torch.testing.assert_close(processed[row], reference_penalties(logits[row], prompt, output, params))
    # and they steer greedy requests: the argmax is taken after them
    assert torch.equal(sampler.sample(logits, args), processed.argmax(-1))


def test_no_api_field_no_extra_work():
    reqs = [_decode_req(i, [1, 2], 1, SamplingParams(temperature=0.7)) for i in range(3)]
    args = Sampler(torch.device("cpu"), VOCAB).prepare(Batch(reqs, "decode"))
    assert not args.processes_logits and args.logprobs is None and args.min_p is None


def test_logit_bias_adds_to_the_named_logits_only():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(logit_bias=[(4, 2.5), (9, -100.0)]), SamplingParams(),
              SamplingParams(logit_bias=[(4, 1.0)])]
    reqs = [_decode_req(i, [1], 1, p) for i, p in enumerate(params)]
    sampler = Sampler(torch.device("cpu"), VOCAB)
    args = sampler.prepare(Batch(reqs, "decode"))
    assert args.logit_bias is not None
    processed = logits.clone()
    apply_logit_bias(processed, args.logit_bias)
    expected = logits.clone()
    expected[0, 4] += 2.5
    expected[0, 9] -= 100.0
    expected[2, 4] += 1.0
    torch.testing.assert_close(processed, expected)
    forced = [SamplingParams(logit_bias=[(13, 100.0)])] * 2
    forced_args = sampler.prepare(Batch([_decode_req(i, [1], 1, p) for i, p in enumerate(forced)], "decode"))
    assert sampler.sample(logits[:2], forced_args).tolist() == [13, 13]  # greedy follows the bias


def test_min_p_keeps_tokens_at_least_min_p_times_the_likeliest():
    probs = torch.tensor([[0.5, 0.2, 0.14, 0.1, 0.06], [0.3, 0.3, 0.2, 0.1, 0.1]])
    kept = apply_min_p(probs, torch.tensor([0.25, 0.0]))
    assert kept[0].nonzero().flatten().tolist() == [0, 1, 2]  # threshold 0.125
    assert torch.equal(kept[1], probs[1])  # min_p 0 keeps everything
    # sampled: only those tokens, in proportion to their renormalised probabilities
    n = 20000
    logits = probs[0].log()
    reqs = [_decode_req(i, [1], 1, SamplingParams(temperature=1.0, min_p=0.25)) for i in range(n)]
    sampler = Sampler(torch.device("cpu"), 5, seed=5)
    tokens = sampler.sample(logits.expand(n, -1), sampler.prepare(Batch(reqs, "decode")))
    freq = torch.bincount(tokens, minlength=5).double() / n
    expected = torch.tensor([0.5, 0.2, 0.14, 0.0, 0.0], dtype=torch.float64) / 0.84
    for p, f in zip(expected.tolist(), freq.tolist()):  # 5 standard deviations of a binomial frequency
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (f, p)


def test_a_grammar_mask_survives_an_infinite_temperature():
    # 1e308 is inf in float32: a masked logit (-inf) over it was NaN and multinomial raised (found by the fuzzer)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[:, [3, 17]] = True
    masked = logits.masked_fill(~allowed, float("-inf"))
    reqs = [_decode_req(i, [1], 1, SamplingParams(temperature=1e308, min_p=0.5)) for i in range(2)]
    sampler = Sampler(torch.device("cpu"), VOCAB)
    for _ in range(10):
        assert set(sampler.sample(masked, sampler.prepare(Batch(reqs, "decode"))).tolist()) <= {3, 17}


def test_a_prompt_chunk_gets_no_processing():
    params = SamplingParams(presence_penalty=1.0, logit_bias=[(3, 5.0)], logprobs=2)
    chunk = Req(torch.arange(8, dtype=torch.int32), 0, 0, 0, 0, params)  # output_len 0: a chunk cannot decode
    args = Sampler(torch.device("cpu"), VOCAB).prepare(Batch([chunk], "prefill"), torch.zeros(1, 16, dtype=torch.int32))
    assert args.penalties is None and args.logit_bias is None
    assert args.logprobs is not None and args.logprobs.rows_host == []


# ---- logprobs against HF ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    from stage4_fast.llm import LLM

    # chunks of 8 tokens: an echoed prompt's logprobs are gathered over several chunks
    llm = LLM(str(tiny_dir), dtype=torch.float32, num_page_override=512, max_extend_tokens=8, cache_type="radix")
    yield llm
    llm.shutdown()


def test_logprobs_equal_log_softmax_of_hf_logits(tiny_llm, tiny_dir):
    prompt = [(37 * i + 11) % 3000 + 100 for i in range(21)]
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, echo=True),
        # the raw model's logprobs, whatever steers the sampling
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, echo=True, temperature=1.3, seed=4, min_p=0.05,
                       presence_penalty=1.0, repetition_penalty=1.2, logit_bias=[(500, 3.0)]),
        SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0),  # no alternatives, no prompt
    ]
    results = tiny_llm.generate([prompt] * 3, params, use_tqdm=False)
    for result, p in zip(results, params):
        ids = prompt + result["token_ids"]
        ref = hf_logprobs(tiny_dir, ids)
        out = result["logprobs"]
        assert out.token_ids == result["token_ids"]
        for step, (value, top_ids, top_values) in enumerate(zip(out.logprobs, out.top_ids, out.top_logprobs)):
            row = ref[len(prompt) - 1 + step]
            assert abs(value - row[ids[len(prompt) + step]].item()) < 1e-4
            assert len(top_ids) == p.logprobs and top_ids == row.topk(p.logprobs).indices.tolist()
            torch.testing.assert_close(torch.tensor(top_values, dtype=torch.float64), row[top_ids], atol=1e-4,
                                       rtol=0)
        if p.echo:
            echoed = result["prompt_logprobs"]
            assert echoed.token_ids == prompt and echoed.logprobs[0] is None and echoed.top_ids[0] == []
            expected = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
            assert max(abs(a - b) for a, b in zip(echoed.logprobs[1:], expected)) < 1e-4
            assert all(top == ref[i].topk(p.logprobs).indices.tolist()
                       for i, top in enumerate(echoed.top_ids[1:]))
        else:
            assert "prompt_logprobs" not in result


def test_echo_logprobs_survive_a_cached_prompt(tiny_llm, tiny_dir):
    prompt = [(53 * i + 7) % 3000 + 100 for i in range(40)]
    plain = SamplingParams(max_tokens=2, ignore_eos=True)
    tiny_llm.generate([prompt], plain, use_tqdm=False)  # the prompt is now in the radix cache
    assert tiny_llm.cache_manager.prefix_cache.match_prefix(torch.tensor(prompt)).cuda_handle.cached_len >= 32
    echo = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=1, echo=True)
    first, second = tiny_llm.generate([prompt, prompt], echo, use_tqdm=False)
    ref = hf_logprobs(tiny_dir, prompt)
    expected = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    for result in (first, second):
        got = result["prompt_logprobs"].logprobs
        assert got[0] is None and len(got) == len(prompt)
        assert max(abs(a - b) for a, b in zip(got[1:], expected)) < 1e-4


def test_a_server_builds_the_grammar_compiler_at_start_up(smollm2_dir, monkeypatch):
    """xgrammar's import and the tokenizer's table once took the first structured request (and every running stream
    with it) seconds on a GPU machine: a server builds them on a thread at start-up, and a request arriving before
    the thread is done waits for the same compiler instead of building a second one."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from stage4_fast.sampling import grammar as grammar_module

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert not grammar_module.GrammarBackend(None, 49152).warm_up_in_background()  # no tokenizer: nothing to do
    backend = grammar_module.GrammarBackend(tokenizer, 49152)
    assert backend.warm_up_in_background()
    backend.add(1, "json_schema", '{"type": "object"}')  # may run while the thread builds: it waits for it
    assert backend.warm_up_thread is not None
    backend.warm_up_thread.join(timeout=120)
    compiler = backend._compiler
    assert compiler is not None and backend.has(1)
    backend.add(2, "json_schema", '{"type": "array"}')
    assert backend._compiler is compiler
    monkeypatch.setattr(grammar_module.importlib.util, "find_spec", lambda name: None)  # xgrammar not installed
    assert not grammar_module.GrammarBackend(tokenizer, 49152).warm_up_in_background()



def test_without_xgrammar_a_structured_request_is_refused_by_name(monkeypatch):
    """xgrammar is a base dependency, but an environment can lack it (installed --no-deps, or removed): a request
    with a grammar is then refused with what to install (the scheduler answers it as a 400), and a server starts
    without the warm-up thread."""
    import sys

    from stage4_fast.sampling import grammar as grammar_module

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    backend = grammar_module.GrammarBackend(None, 64)
    with pytest.raises(grammar_module.GrammarError, match=r"needs the xgrammar package \(pip install xgrammar\)"):
        backend.add(1, "regex", "a+")
    assert not backend.has(1)
    assert isinstance(grammar_module.GrammarError("x"), ValueError)  # what the scheduler turns into a rejection

# ---- grammar masks: the host buffer, and overlap with the previous step ------------------------------------------


def test_grammar_masks_are_filled_row_for_row_into_one_reused_buffer(smollm2_dir):
    """The batch matcher writes each grammar row whole and the other rows allow everything, so a buffer reused from
    step to step (rows changing roles) gives exactly the masks of a fresh one filled matcher by matcher."""
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from stage4_fast.sampling import GrammarBackend

    vocab = 49152
    backend = GrammarBackend(AutoTokenizer.from_pretrained(smollm2_dir), vocab)
    backend.add(1, "json_schema", '{"type": "array", "items": {"type": "integer"}}')
    backend.add(2, "json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}')
    assert backend.matchers[1].accept_string("[12,")

    def fresh(uids: List[int | None]) -> torch.Tensor:
        mask = xgr.allocate_token_bitmask(len(uids), vocab)
        for row, uid in enumerate(uids):
            if uid is not None:
                backend.matchers[uid].fill_next_token_bitmask(mask, row)
        return mask

    first = backend.bitmask([1, None, 2])
    assert torch.equal(first, fresh([1, None, 2])) and (first[1] == -1).all()
    buffer = first.data_ptr()
    for uids in ([None, 2, 1], [2, 1, None, None], [None, None]):
        got = backend.bitmask(uids)
        assert got.data_ptr() == buffer, "the same buffer every step"
        assert torch.equal(got, fresh(uids)), uids
    assert torch.equal(backend.device_bitmask([1, 2], torch.device("cpu")), fresh([1, 2]))


def test_grammar_steps_overlap_the_previous_step_and_generate_what_the_plain_loop_does(tiny_dir):
    """With a grammar request running, batch N+1's forward is launched before batch N's tokens are processed (its
    masks are filled after that, before its sampling): the outputs are the normal loop's, token for token, for
    grammar and plain requests side by side."""
    pytest.importorskip("xgrammar")
    from stage4_fast.llm import LLM

    schema = '{"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 3}'
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, json_schema=schema),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, json_schema='{"type": "object"}'),
              SamplingParams(temperature=0.0, max_tokens=7, json_schema=schema)]
    outputs, events = {}, []
    for overlap in (True, False):
        llm = LLM(str(tiny_dir), dtype=torch.float32, num_page_override=256, overlap_scheduling=overlap)
        if overlap:
            forward_batch, process = llm.engine.forward_batch, llm._process_last_data

            def launch(batch, args, before_sampling=None, forward_batch=forward_batch):
                events.append("launch")
                return forward_batch(batch, args, before_sampling)

            def processed(last_data, process=process):
                if last_data is not None:
                    events.append("process")
                return process(last_data)

            llm.engine.forward_batch = launch  # type: ignore[method-assign]
            llm._process_last_data = processed  # type: ignore[method-assign]
        outputs[overlap] = [r["token_ids"] for r in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outputs[True] == outputs[False]
    assert all(len(out) > 0 for out in outputs[True])
    # overlapped: after the first launch every batch is launched before its predecessor is processed
    assert events[:3] == ["launch", "launch", "process"], events[:6]
    assert events.count("launch") == events.count("process")


def test_a_grammar_row_never_samples_an_id_past_the_tokenizer(smollm2_dir):
    """Logits wider than the tokenizer (a padded vocabulary): the grammars are built over the tokenizer's ids only
    (xgrammar would call every padded id a special token and check each token slower for it), and the padded ids
    are forbidden in a grammar's rows by the sampler — not in the other rows of the batch."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from stage4_fast.sampling import GrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    width = len(tokenizer) + 100
    backend = GrammarBackend(tokenizer, width)
    assert backend.grammar_vocab == len(tokenizer)
    backend.add(7, "json_schema", '{"type": "array", "items": {"type": "integer"}}')
    sampler = Sampler(torch.device("cpu"), width)
    sampler.grammar = backend
    reqs = [_decode_req(0, [1, 2], 0, SamplingParams()), _decode_req(1, [3], 0, SamplingParams())]
    reqs[0].uid = 7  # row 0 under the grammar, row 1 free
    args = sampler.prepare(Batch(reqs, "decode"))
    assert args.grammar_uids == [7, 1] and args.grammar_bitmask is None  # filled just before sampling
    sampler.fill_grammar_mask(args)
    assert args.grammar_bitmask is not None and args.grammar_bitmask.shape[1] == (len(tokenizer) + 31) // 32
    logits = torch.zeros(2, width)
    logits[:, len(tokenizer) + 5] = 100.0  # a padded id, by far the likeliest
    logits[:, tokenizer.convert_tokens_to_ids("[")] = 1.0  # the only way a JSON array can start
    tokens = sampler.sample(logits, args).tolist()
    assert tokens == [tokenizer.convert_tokens_to_ids("["), len(tokenizer) + 5]


def test_min_tokens_holds_the_stop_tokens_back_until_the_output_is_long_enough():
    eos = 7
    cases = [  # (outputs so far, params, the stop tokens this step may not sample)
        (0, SamplingParams(min_tokens=3), [eos]),
        (2, SamplingParams(min_tokens=3, stop_token_ids=[9]), [eos, 9]),  # this step samples the 3rd
        (3, SamplingParams(min_tokens=3, stop_token_ids=[9]), []),  # ... and this one the 4th: free
        (0, SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[9]), [9]),  # EOS ends nothing here
        (0, SamplingParams(min_tokens=3, stop_token_ids=[-1, VOCAB, 2**31 - 1]), [eos]),  # never sampled anyway
        (0, SamplingParams(), []),
    ]
    reqs = [_decode_req(i, [1, 2], n, p) for i, (n, p, _) in enumerate(cases)]
    sampler = Sampler(torch.device("cpu"), VOCAB)
    sampler.eos_token_id = eos
    assert [sampler._stops_held_back(r) for r in reqs] == [held for _, _, held in cases]
    logits = torch.randn(len(cases), VOCAB, generator=torch.Generator().manual_seed(3))
    logits[:, eos], logits[:, 9], logits[:, 11] = 30.0, 20.0, 10.0  # EOS, then 9, then 11 the likeliest
    args = sampler.prepare(Batch(reqs, "decode"))
    assert sampler.sample(logits, args).tolist() == [9, 11, eos, eos, 9, eos]


def test_an_offline_llm_takes_a_regex_or_a_grammar_and_refuses_both(tiny_dir):
    """SGLang's structured output fields of SamplingParams: the random model's samples keep to a regular
    expression or an EBNF grammar; a request with two of them is refused with the reason, the others run."""
    pytest.importorskip("xgrammar")
    import re

    from stage4_fast.llm import LLM

    params = [SamplingParams(temperature=1.0, seed=1, max_tokens=20, regex="(yes|no)-[0-9]{2}"),
              SamplingParams(temperature=1.0, seed=2, max_tokens=20, ebnf='root ::= "x" ("a" | "b") ("a" | "b") "y"'),
              SamplingParams(max_tokens=20, regex="a", ebnf='root ::= "a"')]
    llm = LLM(str(tiny_dir), dtype=torch.float32, num_page_override=256)
    try:
        regex, grammar, both = llm.generate([[5, 6, 7]] * 3, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert re.fullmatch("(yes|no)-[0-9]{2}", regex["text"]), regex
    assert re.fullmatch("x[ab]{2}y", grammar["text"]), grammar
    assert "only one of json_schema, regex, ebnf and structural_tag" in both["error"], both


def test_json_holds_free_whitespace_only_where_a_request_allows_it(smollm2_dir, tiny_dir):
    """A JSON schema's output holds no whitespace between its tokens unless the request allows it
    (``SamplingParams.json_any_whitespace``, vLLM's disable_any_whitespace: false), and the scheduler compiles each
    request's grammar as its params say; asked without a JSON schema, it is refused (it would change nothing)."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from stage4_fast.llm import LLM
    from stage4_fast.sampling import GrammarBackend

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    backend = GrammarBackend(AutoTokenizer.from_pretrained(smollm2_dir), 49152)
    for uid, free in enumerate((False, True)):
        backend.add(uid, "json_schema", schema, free)
        assert backend.matchers[uid].accept_string('{\n  "a" : 1 }') == free
        backend.add(uid, "json_schema", schema, free)
        assert backend.matchers[uid].accept_string('{"a": 1}')  # the one spacing JSON holds without free whitespace
    llm = LLM(str(tiny_dir), dtype=torch.float32, num_page_override=256)
    added = []
    grammar = llm.grammar
    add = grammar.add
    grammar.add = lambda uid, kind, source, free=False: (added.append((kind, free)), add(uid, kind, source, free))[1]
    try:
        params = [SamplingParams(max_tokens=3, json_schema=schema, json_any_whitespace=free) for free in (False, True)]
        params.append(SamplingParams(max_tokens=3, regex="a", json_any_whitespace=True))  # no JSON to loosen
        *_, regex = llm.generate([[5, 6, 7]] * 3, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert added == [("json_schema", False), ("json_schema", True)]
    assert "json_any_whitespace applies to a json_schema only" in regex["error"], regex


def test_a_structural_tag_in_either_form_leaves_text_free_until_a_trigger(smollm2_dir):
    """vLLM's and SGLang's structural tag: free text until a trigger, then the tagged structure (JSON held to its
    schema) and its end. xgrammar's own form and the older {structures, triggers} both compile to it."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from stage4_fast.sampling import GrammarBackend
    from stage4_fast.sampling.grammar import GrammarError

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
    older = {"structures": [{"begin": "<f=weather>", "schema": schema, "end": "</f>"}], "triggers": ["<f="]}
    newer = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [
        {"begin": "<f=weather>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</f>"}]}}
    backend = GrammarBackend(AutoTokenizer.from_pretrained(smollm2_dir), 49152)
    for uid, tag in enumerate((older, newer)):
        backend.add(uid, "structural_tag", json.dumps(tag))
        assert backend.matchers[uid].accept_string('Let me see. <f=weather>{"city": "Paris"}</f> Done.')
        backend.add(uid, "structural_tag", json.dumps(tag))
        assert not backend.matchers[uid].accept_string('<f=weather>{"city": "Lyon"}')  # held to the schema
    with pytest.raises(GrammarError, match="unsupported structural tag: each of structures needs begin"):
        backend.add(9, "structural_tag", '{"structures": [{"begin": "<a>"}]}')
    with pytest.raises(GrammarError, match="unsupported structural tag"):
        backend.add(9, "structural_tag", "not json")
