"""IPC messages survive the wire: dataclass -> dict -> msgpack -> dict -> dataclass, tensors bit-exact."""

from __future__ import annotations

import msgpack
import pytest
import torch

from stage3_served.core import SamplingParams
from stage3_served.message import (
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
    TokenizeMsg,
    UserMsg,
    UserReply,
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


def test_unknown_type_on_the_wire_is_refused():
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
