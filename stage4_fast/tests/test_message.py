"""IPC messages survive the wire: dataclass -> dict -> msgpack -> dict -> dataclass, tensors bit-exact."""

from __future__ import annotations

import msgpack
import pytest
import torch

from stage4_fast.core import SamplingParams
from stage4_fast.message import (
    AbortBackendMsg,
    AbortMsg,
    BaseBackendMsg,
    BaseFrontendMsg,
    BaseTokenizerMsg,
    BatchBackendMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    ExitMsg,
    StatsBackendMsg,
    StatsMsg,
    StatsQueryMsg,
    StatsReply,
    TextLogprobs,
    TokenColumnsMsg,
    TokenizeMsg,
    TokenLogprobs,
    UserMsg,
    UserReply,
    expand_columns,
)


def _wire(msg, base):
    return base.decoder(msgpack.unpackb(msgpack.packb(msg.encoder(), use_bin_type=True), raw=False))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def test_user_msg_round_trip_keeps_ids_and_sampling_params():
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, ignore_eos=True, max_tokens=33, seed=4,
                            stop_token_ids=[2, 7])
    msg = UserMsg(uid=12, input_ids=torch.tensor([1, 49151, 0, 77], dtype=torch.int32), sampling_params=params)
    back = _wire(msg, BaseBackendMsg)
    assert _same(msg, back)
    back.input_ids[0] = 5  # a private, writable copy
    assert msg.input_ids[0] == 1


def test_plain_lists_pass_as_they_are_and_lists_of_messages_still_decode():
    """A prompt's token ids travel as the list itself (no call per id); a list that holds messages, alone or beside
    plain values, is still walked on both ends."""
    ids = list(range(100, 700))
    msg = TokenizeMsg(uid=3, text=ids, sampling_params=SamplingParams(stop_token_ids=[2, 7]))
    encoded = msg.encoder()
    assert encoded["text"] is ids
    assert _same(_wire(msg, BaseTokenizerMsg), msg)
    mixed = TokenizeMsg(uid=4, text=[1, AbortMsg(uid=9), "x"], sampling_params=SamplingParams())
    back = _wire(mixed, BaseTokenizerMsg)
    assert back.text[0] == 1 and isinstance(back.text[1], AbortMsg) and back.text[1].uid == 9 and back.text[2] == "x"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16])
def test_tensor_dtypes_and_shapes_are_bit_exact(dtype):
    t = (torch.arange(12, dtype=torch.float32) * 1.37 - 3).to(dtype).reshape(3, 4)
    back = _wire(UserMsg(0, t, SamplingParams()), BaseBackendMsg).input_ids
    assert back.dtype == dtype and back.shape == (3, 4) and torch.equal(back, t)
    empty = _wire(UserMsg(0, torch.empty(0, dtype=dtype), SamplingParams()), BaseBackendMsg).input_ids
    assert empty.dtype == dtype and empty.numel() == 0


@pytest.mark.parametrize(
    "msg, base",
    [
        (BatchBackendMsg([UserMsg(1, torch.tensor([3], dtype=torch.int32), SamplingParams()), AbortBackendMsg(1),
                          StatsBackendMsg(9), ExitMsg()]), BaseBackendMsg),
        (BatchTokenizerMsg([DetokenizeMsg(1, 42, False), DetokenizeMsg(2, -1, True, "too long", "error", 5, 0),
                            StatsMsg(3, {"free_pages": 10, "nested": {"a": [1, 2]}})]), BaseTokenizerMsg),
        (TokenizeMsg(4, [{"role": "user", "content": "hé 😀"}], SamplingParams()), BaseTokenizerMsg),
        (TokenizeMsg(5, [1, 2, 3], SamplingParams()), BaseTokenizerMsg),
        (AbortMsg(6), BaseTokenizerMsg),
        (StatsQueryMsg(6), BaseTokenizerMsg),
        (BatchFrontendMsg([UserReply(1, "世界", False, prompt_tokens=3, completion_tokens=1),
                           StatsReply(2, {"x": 1})]), BaseFrontendMsg),
    ],
)
def test_every_message_kind_round_trips(msg, base):
    assert _same(msg, _wire(msg, base))


@pytest.mark.parametrize(
    "msg, base",
    [
        (BatchTokenizerMsg([DetokenizeMsg(u, 100 + u, u == 2, None if u < 2 else "x", "length" if u == 2 else "")
                            for u in range(3)]), BaseTokenizerMsg),
        (BatchFrontendMsg([UserReply(1, "世界", False, prompt_tokens=3), UserReply(2, "", True, "stop", 4, 5, 1)]),
         BaseFrontendMsg),
        (BatchBackendMsg([UserMsg(u, torch.arange(u + 1, dtype=torch.int32), SamplingParams(stop_token_ids=[u]))
                          for u in range(3)]), BaseBackendMsg),  # tensors and nested messages inside the columns
        (BatchTokenizerMsg([AbortMsg(7), AbortMsg(9)]), BaseTokenizerMsg),  # a message of one field
    ],
)
def test_a_batch_of_one_kind_travels_as_columns(msg, base):
    """One step's tokens of every request: one list per field on the wire, not one dict per message."""
    wire = msg.encoder()["data"]
    assert wire["__type__"] == "__columns__" and len(next(iter(wire["fields"].values()))) == len(msg.data)
    assert _same(msg, _wire(msg, base))
    # the receiver walks only the columns the sender encoded (nested messages, tensors): plain ones stay as they came
    plain = [name for name, values in wire["fields"].items() if all(isinstance(v, (int, str, type(None)))
                                                                      for v in values)]
    assert set(wire["encoded"]).isdisjoint(plain)


def test_columns_in_another_field_order_still_decode():
    """Rows are built positionally when the columns come in the class's field order (the sender's); any other order
    is decoded by name."""
    wire = BatchFrontendMsg([UserReply(1, "a", False), UserReply(2, "b", True, "stop")]).encoder()
    wire["data"]["fields"] = dict(reversed(list(wire["data"]["fields"].items())))
    got = BaseFrontendMsg.decoder(wire).data
    assert [(r.uid, r.incremental_output, r.finished, r.finish_reason) for r in got] == [(1, "a", False, ""),
                                                                                         (2, "b", True, "stop")]


def test_a_steps_plain_tokens_travel_as_three_lists_and_read_as_their_rows():
    columns = TokenColumnsMsg([4, 9, 2], [100, 101, 102], [True, False, True])
    step = BatchTokenizerMsg([DetokenizeMsg(7, 5, True, finish_reason="length"), columns])
    wire = step.encoder()["data"][1]
    assert wire == {"__type__": "TokenColumnsMsg", "uids": [4, 9, 2], "tokens": [100, 101, 102],
                    "skip_special_tokens": [True, False, True]}  # three plain lists: msgpack packs them in C
    got = _wire(step, BaseTokenizerMsg)
    assert got.data[1] == columns
    rows = expand_columns(got.data)
    assert rows == [DetokenizeMsg(7, 5, True, finish_reason="length"), DetokenizeMsg(4, 100, False),
                    DetokenizeMsg(9, 101, False, skip_special_tokens=False), DetokenizeMsg(2, 102, False)]
    plain = [DetokenizeMsg(1, 2, False)]
    assert expand_columns(plain) is plain  # nothing to expand: the list itself


# stage 4: the production API's fields and logprobs
API_PARAMS = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.2, repetition_penalty=1.3, min_p=0.1,
                            logit_bias=[(5, 2.0), (49151, -100.0)], logprobs=3, echo=True, json_schema='{"type": "x"}')
PROMPT_LP = TokenLogprobs([7, 8, 9], [None, -1.5, -0.25], [[], [3, 4], [5, 6]], [[], [-0.1, -2.0], [-0.2, -3.0]])


@pytest.mark.parametrize(
    "msg, base",
    [
        (UserMsg(3, torch.tensor([1, 2], dtype=torch.int32), API_PARAMS), BaseBackendMsg),
        (BatchTokenizerMsg([DetokenizeMsg(1, 9, False, logprobs=TokenLogprobs([9], [-0.5], [[9, 4]], [[-0.5, -1.0]]),
                                          prompt_logprobs=PROMPT_LP),
                            DetokenizeMsg(2, 4, True, finish_reason="length")]), BaseTokenizerMsg),
        (BatchFrontendMsg([UserReply(1, "a", False, logprobs=TextLogprobs(["a"], [-0.5], [["a", "b"]], [[-0.5, -1.0]]),
                                     prompt_logprobs=TextLogprobs(["x", "y"], [None, -1.0], [[], ["y"]], [[], [-1.0]]),
                                     prompt_text="xy"),
                           UserReply(2, "", True, "stop")]), BaseFrontendMsg),
    ],
)
def test_api_fields_and_logprobs_round_trip(msg, base):
    assert _same(msg, _wire(msg, base))


def test_merged_replies_keep_every_logprob():
    first = UserReply(1, "a", False, prompt_tokens=2, logprobs=TextLogprobs(["a"], [-0.5], [["a"]], [[-0.5]]),
                      prompt_logprobs=TextLogprobs(["x"], [None], [[]], [[]]), prompt_text="x")
    later = UserReply(1, "b", True, "length", logprobs=TextLogprobs(["b"], [-0.7], [["c"]], [[-0.1]]))
    merged = first.followed_by(later)
    assert merged.incremental_output == "ab" and merged.logprobs.tokens == ["a", "b"]
    assert merged.logprobs.logprobs == [-0.5, -0.7] and merged.logprobs.top_tokens == [["a"], ["c"]]
    assert merged.prompt_text == "x" and merged.prompt_logprobs.tokens == ["x"]
    assert first.logprobs.tokens == ["a"]  # the parts are left as they were


def test_encoded_columns_must_be_fields():
    wire = BatchFrontendMsg([UserReply(1, "a", False), UserReply(2, "b", True)]).encoder()
    wire["data"]["encoded"] = ["__class__"]
    with pytest.raises(TypeError, match="encoded columns"):
        BaseFrontendMsg.decoder(wire)


def test_unknown_type_on_the_wire_is_refused():
    with pytest.raises(TypeError, match="unknown message type"):
        BaseTokenizerMsg.decoder({"__type__": "__columns__", "cls": "os.system", "fields": {"cmd": ["true"]},
                                  "encoded": []})
    with pytest.raises(TypeError, match="unknown message type"):
        BaseBackendMsg.decoder({"__type__": "os.system", "cmd": "true"})
    # a frontend message is not a backend message
    with pytest.raises(TypeError):
        BaseBackendMsg.decoder(UserReply(1, "x", True).encoder())


@pytest.mark.parametrize("marker", ["AbortMsg", "Tensor", "__columns__", "__dict__"])
def test_a_plain_dict_with_the_type_key_stays_a_plain_dict(marker):
    """Keys of plain dicts are data (a chat message's, a client's): one spelling the codec's own "__type__" marker
    must come back as the same dict, not as a message, a tensor or an error."""
    text = [{"role": "user", "content": "x", "__type__": marker, "uid": 1, "items": {"__type__": marker}}]
    back = _wire(TokenizeMsg(3, text, SamplingParams()), BaseTokenizerMsg)
    assert back.text == text and type(back.text[0]) is dict
