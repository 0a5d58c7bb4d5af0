"""A request's host-side token ids: appends store into a buffer with spare room, and input_ids is the view of its
filled part, built when it is read (core.py, Req.append_host)."""

from __future__ import annotations

import pytest
import torch

from stage4_fast.core import Req, SamplingParams
from stage4_fast.utils import int_tensor
from stage4_fast.utils.device import PACK_ALIGN_BYTES, to_device_packed


def _req(prompt: list[int], output_len: int) -> Req:
    return Req(input_ids=torch.tensor(prompt, dtype=torch.int32), table_idx=0, cached_len=0, output_len=output_len,
               uid=0, sampling_params=SamplingParams())


@pytest.mark.parametrize("read_between", [True, False], ids=["read-between", "unread"])
def test_appended_tokens_read_back_and_earlier_views_keep_their_length(read_between: bool) -> None:
    req = _req([5, 6, 7], output_len=200)
    views = []
    for step in range(150):  # past the first buffer (2 x 3 or 3 + 64 ids): it grows and copies once
        if read_between or step == 0:  # unread: the buffer is full with nobody having read the view since
            views.append(req.input_ids)
        req.append_host(100 + step if step % 2 else torch.tensor(100 + step))
    assert req.input_ids.tolist() == [5, 6, 7] + list(range(100, 250))
    assert req.input_ids.dtype == torch.int32
    for k, view in enumerate(views):  # a view taken earlier still shows the ids of that moment
        assert view.tolist() == ([5, 6, 7] + list(range(100, 250)))[: 3 + k]


def test_the_view_is_built_once_per_read_not_per_append() -> None:
    req = _req([1, 2], output_len=10)
    req.append_host(3)
    req.append_host(4)
    assert "input_ids" not in req.__dict__  # nothing read it since the last append
    first = req.input_ids
    assert req.input_ids is first and first.tolist() == [1, 2, 3, 4]


def test_ids_assigned_from_outside_are_where_appends_continue() -> None:
    req = _req([1, 2], output_len=10)
    req.append_host(3)
    req.input_ids = torch.tensor([9, 9, 9, 9], dtype=torch.int32)
    req.append_host(5)
    assert req.input_ids.tolist() == [9, 9, 9, 9, 5]


def test_a_missing_attribute_is_still_an_attribute_error() -> None:
    req = _req([1], output_len=2)
    req.append_host(2)
    with pytest.raises(AttributeError, match="not_an_attribute"):
        req.not_an_attribute  # noqa: B018
    assert not hasattr(req, "also_missing") and req.input_ids.tolist() == [1, 2]


def test_int_tensor_matches_torch_tensor() -> None:
    values = [0, 7, 2**31 - 1, -1]
    for dtype in (torch.int32, torch.int64):
        assert torch.equal(int_tensor(values, dtype), torch.tensor(values, dtype=dtype))
    assert int_tensor([]).shape == (0,) and int_tensor([]).dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_packed_upload_gives_each_vector_back_on_a_16_byte_boundary(dtype) -> None:
    parts = [int_tensor(list(range(n)), dtype) + 10 * n for n in (3, 1, 6, 0, 5)]
    views = to_device_packed(parts, torch.device("cpu"))
    for part, view in zip(parts, views):
        assert view.data_ptr() % PACK_ALIGN_BYTES == 0 and view.dtype == dtype
        assert torch.equal(view, part)


def test_offline_outputs_decode_in_batches_as_one_by_one(smollm2_dir) -> None:
    """LLM.generate decodes every output's text at the end in one call per skip_special_tokens setting: the texts
    are tokenizer.decode's, special tokens kept or skipped as each request asked."""
    from types import SimpleNamespace

    from stage4_fast.llm.llm import LLM, RequestStatus
    from stage4_fast.utils.hf import load_tokenizer

    tok = load_tokenizer(str(smollm2_dir))
    special = tok.convert_tokens_to_ids("<|im_end|>")
    outputs = [[28, 905, 314, special, 1911], [special], [], [9906, 30, 2, 17, special, 442]]
    skips = [True, False, True, False]
    status = {uid: RequestStatus(uid, [1], ids, skip_special_tokens=skip)
              for uid, (ids, skip) in enumerate(zip(outputs, skips))}
    texts = LLM._decode_outputs(SimpleNamespace(tokenizer=tok, status_map=status), len(outputs))
    assert texts == [tok.decode(ids, skip_special_tokens=skip) for ids, skip in zip(outputs, skips)]
    assert "<|im_end|>" in texts[1] and "<|im_end|>" not in texts[0]
    assert LLM._decode_outputs(SimpleNamespace(tokenizer=None, status_map=status), 4) == [""] * 4
