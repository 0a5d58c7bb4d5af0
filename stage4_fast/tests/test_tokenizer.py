"""Tokenize (chat template, no double BOS) and incremental, UTF-8-safe detokenization with SmolLM2's tokenizer."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from stage4_fast.core import SamplingParams
from stage4_fast.message import AbortMsg, DetokenizeMsg, StatsMsg, StatsQueryMsg, TokenizeMsg, UserReply
from stage4_fast.tokenizer import DetokenizeManager, TokenizeManager
from stage4_fast.tokenizer.server import _handle

from .conftest import prepared_model

TEXTS = [
    "Emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵!",
    "中文文本：你好，世界。日本語のテキストと한국어 텍스트.",
    "naïve café — “quotes” … ∑ x² ≤ ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "mixed: 价格 €42 😀 ok\nnew line\tand tab",
]


@lru_cache(maxsize=1)
def smollm2() -> Path:
    return prepared_model("smollm2")


@lru_cache(maxsize=1)
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2())


def _stream(ids: list[int], finish_reason: str = "length", uid: int = 1, mgr=None,
            skip_special_tokens: bool = True) -> list[UserReply]:
    mgr = mgr or DetokenizeManager(tokenizer())
    last = len(ids) - 1
    return [mgr.detokenize_one(DetokenizeMsg(uid, t, i == last, finish_reason=finish_reason if i == last else "",
                                             skip_special_tokens=skip_special_tokens))
            for i, t in enumerate(ids)]


@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_never_stream_a_replacement_char(text):
    tok = tokenizer()
    ids = tok.encode(text)
    # the test is only meaningful if some character really is split across tokens
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))
    replies = _stream(ids)
    assert all("\ufffd" not in r.incremental_output for r in replies)
    assert "".join(r.incremental_output for r in replies) == tok.decode(ids) == text


def test_text_appears_as_soon_as_its_character_is_complete():
    tok = tokenizer()
    ids = tok.encode("a😀b")
    outs = [r.incremental_output for r in _stream(ids)]
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if "\ufffd" not in text:  # everything complete so far has been sent, no later
            assert "".join(outs[:k]) == text




def test_a_running_request_keeps_no_text_it_has_sent():
    """A request's status holds only text not sent yet: a whole text kept and grown with += would be copied at every
    step, a cost that grows with the output."""
    tok = tokenizer()
    mgr = DetokenizeManager(tok)
    ids = tok.encode(" ".join(TEXTS) * 8)
    sent = [mgr.detokenize_one(DetokenizeMsg(1, t, False)).incremental_output for t in ids]
    assert "".join(sent) == tok.decode(ids)
    kept = [v for v in vars(mgr.decode_map[1]).values() if isinstance(v, str)]
    assert sum(map(len, kept)) == 0, kept

@lru_cache(maxsize=1)
def lone_bytes() -> list[int]:
    """Ids of one-byte tokens that no UTF-8 character starts with (a continuation byte alone): any run of them
    decodes to one U+FFFD per token."""
    tok = tokenizer()
    return [i for i in range(len(tok)) if tok.decode([i] * 4) == "\ufffd" * 4]


def test_invalid_bytes_stream_three_tokens_behind_instead_of_at_the_end():
    """A run of bytes that are no UTF-8 (what a random model may emit) would end every window in U+FFFD: it streams
    three tokens behind as decoding all ids gives it, not all at the request's end; the text after it as before."""
    tok = tokenizer()
    ids = tok.encode("ok ") + [lone_bytes()[0]] * 8 + tok.encode(" done")
    outs = [r.incremental_output for r in _stream(ids)]
    full = tok.decode(ids)
    assert "".join(outs) == full and full.count("\ufffd") == 8
    for k in range(4, len(ids) + 1):
        sent = "".join(outs[:k])
        assert full.startswith(sent) and sent.startswith(tok.decode(ids[: k - 3]))



def test_a_character_split_by_hidden_special_tokens_streams_whole():
    """Hidden special tokens between a character's bytes carry no byte: they do not count towards the tokens after
    which held text is sent, so the character still streams whole."""
    tok = tokenizer()
    emoji = tok.encode("😀")
    ids = emoji[:1] + [tok.convert_tokens_to_ids("<|im_end|>")] * 4 + emoji[1:] + tok.encode(" ok")
    outs = [r.incremental_output for r in _stream(ids)]
    assert "".join(outs) == tok.decode(ids, skip_special_tokens=True) == "😀 ok"
    assert all("\ufffd" not in o for o in outs)

@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(min_value=0, max_value=len(TEXTS) - 1),
                          st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6)),
                min_size=1, max_size=5),
       st.lists(st.integers(min_value=0, max_value=10**6), max_size=8), st.booleans())
def test_text_and_invalid_bytes_stream_only_what_decoding_all_ids_gives(pieces, specials, skip):
    """Texts with split characters and runs of lone bytes in any order, special tokens anywhere (also between a
    character's bytes, where a hidden one carries none): what has streamed is always the start of decoding all ids
    (nothing sent is ever taken back), and at the end all of it."""
    tok = tokenizer()
    lone = lone_bytes()
    ids = [i for p in pieces for i in (tok.encode(TEXTS[p]) if isinstance(p, int) else [lone[j] for j in p])]
    for at in specials:
        ids.insert(at % (len(ids) + 1), tok.convert_tokens_to_ids("<|im_end|>"))
    full, sent = tok.decode(ids, skip_special_tokens=skip), ""
    for r in _stream(ids, skip_special_tokens=skip):
        sent += r.incremental_output
        assert full.startswith(sent)
    assert sent == full

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TEXTS) - 1), min_size=1, max_size=4),
       st.integers(min_value=0, max_value=2**31))
def test_any_interleaving_of_requests_decodes_each_exactly(picks, seed):
    """Several requests' tokens interleaved at random, as the scheduler sends them: each stream equals its own
    decode and never carries U+FFFD."""
    tok = tokenizer()
    mgr = DetokenizeManager(tok)
    rng = random.Random(seed)
    ids = {uid: tok.encode(TEXTS[p]) for uid, p in enumerate(picks)}
    pos = {uid: 0 for uid in ids}
    out = {uid: "" for uid in ids}
    while pos:
        uid = rng.choice(sorted(pos))
        i = pos[uid]
        last = i == len(ids[uid]) - 1
        r = mgr.detokenize_one(DetokenizeMsg(uid, ids[uid][i], last, finish_reason="length" if last else ""))
        assert "\ufffd" not in r.incremental_output
        out[uid] += r.incremental_output
        pos[uid] += 1
        if last:
            del pos[uid]
    assert out == {uid: tok.decode(v) for uid, v in ids.items()}
    assert mgr.decode_map == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TEXTS) - 1), min_size=1, max_size=4),
       st.integers(min_value=0, max_value=2**31))
def test_batches_decode_like_one_message_at_a_time(picks, seed):
    """The worker decodes what it drained from its queue in one go: one step's tokens of every request, or several
    steps (a request then appears more than once). Same replies as message by message, in the same order, also when
    some requests hide special tokens and others show them, and through runs of lone bytes."""
    tok = tokenizer()
    rng = random.Random(seed)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    lone = lone_bytes()
    ids = {uid: tok.encode(TEXTS[p]) + [im_end] + [lone[uid]] * 5 + tok.encode(" z") for uid, p in enumerate(picks)}
    skip = {uid: rng.random() < 0.5 for uid in ids}
    msgs, pos = [], {uid: 0 for uid in ids}
    while pos:
        uid = rng.choice(sorted(pos))
        i = pos[uid]
        last = i == len(ids[uid]) - 1
        msgs.append(DetokenizeMsg(uid, ids[uid][i], last, finish_reason="length" if last else "",
                                  skip_special_tokens=skip[uid]))
        pos[uid] += 1
        if last:
            del pos[uid]
    one_by_one = DetokenizeManager(tok)
    expected = [one_by_one.detokenize([m]) for m in msgs]
    batched, replies, start = DetokenizeManager(tok), [], 0
    while start < len(msgs):
        size = rng.randint(1, 8)
        replies += batched.detokenize(msgs[start : start + size])
        start += size
    assert replies == [r for rs in expected for r in rs]
    assert batched.decode_map == {}
    texts = {uid: "".join(r.incremental_output for r in replies if r.uid == uid) for uid in ids}
    assert texts == {uid: tok.decode(v, skip_special_tokens=skip[uid]) for uid, v in ids.items()}


def test_final_eos_is_counted_but_not_shown():
    tok = tokenizer()
    ids = tok.encode("Paris.") + [tok.eos_token_id]
    replies = _stream(ids, finish_reason="stop")
    assert "".join(r.incremental_output for r in replies) == "Paris."
    assert replies[-1].finished and replies[-1].finish_reason == "stop"
    assert replies[-1].completion_tokens == len(ids)


@pytest.mark.parametrize("at_end", [False, True])
def test_special_tokens_hidden_unless_the_request_keeps_them(at_end):
    """Special tokens inside an (ignore_eos) request's output, or last in it: hidden by default (vLLM / SGLang's
    skip_special_tokens=true), text with skip_special_tokens=false; the stream equals the whole decode either way."""
    tok = tokenizer()
    specials = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])  # the latter is its EOS
    ids = tok.encode("a") + specials + tok.encode(" b") + (specials if at_end else [])
    kept = "".join(r.incremental_output for r in _stream(ids, skip_special_tokens=False))
    hidden = "".join(r.incremental_output for r in _stream(ids, skip_special_tokens=True))
    assert kept == tok.decode(ids) == "a<|endoftext|><|im_end|> b" + ("<|endoftext|><|im_end|>" if at_end else "")
    assert hidden == tok.decode(ids, skip_special_tokens=True) == "a b"


def test_length_cut_inside_a_character_flushes_what_decode_gives():
    tok = tokenizer()
    ids = tok.encode("x😀")[:-1]  # stops half way through the emoji
    assert "".join(r.incremental_output for r in _stream(ids)) == tok.decode(ids)


def test_abort_and_rejection_leave_no_state():
    mgr = DetokenizeManager(tokenizer())
    mgr.detokenize_one(DetokenizeMsg(1, 100, False))
    mgr.detokenize_one(DetokenizeMsg(1, -1, True, "aborted", finish_reason="abort"))
    r = mgr.detokenize_one(DetokenizeMsg(2, -1, True, "too long", finish_reason="error", prompt_tokens=9000))
    assert r.error == "too long" and r.finished and r.completion_tokens == 0 and r.prompt_tokens == 9000
    assert mgr.decode_map == {}


def test_chat_template_is_applied_and_bos_not_doubled():
    tok = AutoTokenizer.from_pretrained(smollm2())
    # make the tokenizer add BOS on encode, like Llama 3's: the rendered template already starts with it
    bos = tok.bos_token
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)])
    assert tok.encode("hi")[0] == tok.bos_token_id
    messages = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(bos)
    ids = TokenizeManager(tok).tokenize_one(messages)
    assert ids.dtype == torch.int32 and ids.dim() == 1
    assert ids.tolist() == tok.encode(rendered, add_special_tokens=False)
    assert ids.tolist()[:2] != [tok.bos_token_id] * 2  # upstream: encode(rendered) -> BOS BOS ...
    tail = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)  # the generation prompt
    assert ids.tolist()[-len(tail):] == tail


def test_raw_prompt_is_encoded_like_transformers_and_ids_pass_through():
    tok = tokenizer()
    mgr = TokenizeManager(tok)
    assert mgr.tokenize_one("The capital of France is").tolist() == tok("The capital of France is").input_ids
    assert mgr.tokenize_one([5, 6, 7]).tolist() == [5, 6, 7]
    for bad in ([], [{"role": "user", "content": "x"}, 3], [1.5], [True]):
        with pytest.raises(ValueError):
            mgr.tokenize_one(bad)


def test_worker_turns_a_bad_prompt_into_an_error_reply_and_keeps_order():
    tok = tokenizer()
    msgs = [TokenizeMsg(1, "hello", SamplingParams()), AbortMsg(1), TokenizeMsg(2, [], SamplingParams()),
            StatsQueryMsg(3), DetokenizeMsg(4, tok.encode("A")[0], False), StatsMsg(5, {"free_pages": 1})]
    to_frontend, to_backend = _handle(msgs, TokenizeManager(tok), DetokenizeManager(tok))
    assert [type(m).__name__ for m in to_backend] == ["UserMsg", "AbortBackendMsg", "StatsBackendMsg"]
    assert [type(m).__name__ for m in to_frontend] == ["UserReply", "UserReply", "StatsReply"]
    assert to_frontend[0].incremental_output == "A"
    assert to_frontend[1].uid == 2 and to_frontend[1].finished and "prompt" in to_frontend[1].error


def test_chat_options_reach_the_template_as_transformers_renders_them():
    tok = AutoTokenizer.from_pretrained(smollm2())
    # a template variable as Qwen3's enable_thinking: the generation prompt differs when it is false
    tok.chat_template = tok.chat_template.replace(
        "{{ '<|im_start|>assistant\n' }}",
        "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not enable_thinking %}"
        "{{ '<think>\n\n</think>\n\n' }}{% endif %}")
    mgr = TokenizeManager(tok)
    messages = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Bonjour, je"}]

    def hf(**kwargs) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)

    default = mgr.tokenize_one(messages).tolist()
    assert default == hf(add_generation_prompt=True)
    no_thinking = {"enable_thinking": False, "add_generation_prompt": True, "continue_final_message": False}
    assert mgr.tokenize_one(messages, no_thinking).tolist() == hf(add_generation_prompt=True, enable_thinking=False)
    assert mgr.tokenize_one(messages, no_thinking).tolist() != default
    go_on = mgr.tokenize_one(messages, {"add_generation_prompt": False, "continue_final_message": True}).tolist()
    assert go_on == hf(continue_final_message=True)
    assert tok.decode(go_on).endswith("Bonjour, je")  # the assistant's message is left open
    options = {"add_generation_prompt": False, "continue_final_message": False}
    assert not tok.decode(mgr.tokenize_one(messages, options).tolist()).endswith("assistant\n")
