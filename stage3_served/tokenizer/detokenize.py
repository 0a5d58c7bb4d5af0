"""Token ids -> text, incrementally per request, never cutting a multi-byte character.

We decode a window ``ids[surr_offset:]`` and commit the text it adds over ``ids[surr_offset:read_offset]`` only when
it does not end in U+FFFD; the last token flushes the rest, so the stream equals decoding all ids at once.

A character is at most 4 bytes, so only the last 3 non-empty tokens can start one that later tokens complete; when
more are held and the text still ends in U+FFFD (no UTF-8), the text before those 3 is committed as decoding all ids
gives it, instead of holding the stream to the end (as vLLM and SGLang do)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from transformers import PreTrainedTokenizerBase

from ..message import DetokenizeMsg, UserReply

_REPLACEMENT = "\ufffd"
# the tokens that can hold an unfinished character's start: a character is at most 4 bytes, a token at least 1
_UNFINISHED_TOKENS = 3


@dataclass
class DecodeStatus:
    decoded_ids: List[int] = field(default_factory=list)
    decoded_str: str = ""  # text committed so far
    read_offset: int = 0  # ids before this are committed
    surr_offset: int = 0  # start of the left-context window
    sent_offset: int = 0  # characters of decoded_str already sent
    completion_tokens: int = 0  # every generated token, the final EOS too (it is not part of the text)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    skip_special_tokens: bool = True  # as the request asked (SamplingParams)


class DetokenizeManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.decode_map: Dict[int, DecodeStatus] = {}
        self._has_text: Dict[Tuple[int, bool], bool] = {}  # (token id, skip_special_tokens) -> decodes to text alone

    def detokenize(self, msgs: List[DetokenizeMsg]) -> List[UserReply]:
        return [self.detokenize_one(msg) for msg in msgs]

    def detokenize_one(self, msg: DetokenizeMsg) -> UserReply:
        if msg.finished:
            # the request ends here: forget it even if it was aborted or rejected before any token
            status = self.decode_map.pop(msg.uid, None) or DecodeStatus()
        else:
            status = self.decode_map.setdefault(msg.uid, DecodeStatus())
        status.prompt_tokens = msg.prompt_tokens or status.prompt_tokens
        status.cached_tokens = msg.cached_tokens or status.cached_tokens
        if msg.next_token >= 0:
            status.completion_tokens += 1
            # (token messages carry the request's setting; an abort's or an error's carries the default)
            status.skip_special_tokens = msg.skip_special_tokens
            # a request that stopped on EOS / a stop token does not show that token
            if not (msg.finished and msg.finish_reason == "stop"):
                status.decoded_ids.append(msg.next_token)
        self._advance(status, flush=msg.finished)
        new_text = status.decoded_str[status.sent_offset :]
        status.sent_offset = len(status.decoded_str)
        return UserReply(
            uid=msg.uid,
            incremental_output=new_text,
            finished=msg.finished,
            finish_reason=msg.finish_reason,
            prompt_tokens=status.prompt_tokens,
            completion_tokens=status.completion_tokens,
            cached_tokens=status.cached_tokens,
            error=msg.error,
        )

    def _advance(self, s: DecodeStatus, flush: bool) -> None:
        if s.read_offset == len(s.decoded_ids):
            return
        prefix = self._decode(s.decoded_ids[s.surr_offset : s.read_offset], s.skip_special_tokens)
        text = self._decode(s.decoded_ids[s.surr_offset :], s.skip_special_tokens)
        if len(text) > len(prefix) and (flush or not text.endswith(_REPLACEMENT)):
            self._commit_text(s, text[len(prefix) :], len(s.decoded_ids))
        elif text.endswith(_REPLACEMENT) and (end := self._unfinished_start(s)) is not None:
            # invalid bytes held: all but the last tokens' text, where it is the start of the window's
            cut = self._decode(s.decoded_ids[s.surr_offset : end], s.skip_special_tokens)
            if len(cut) > len(prefix) and cut.startswith(prefix) and text.startswith(cut):
                self._commit_text(s, cut[len(prefix) :], end)

    def _unfinished_start(self, s: DecodeStatus) -> int | None:
        """Where the held ids' last 3 tokens with text begin when more are held, else None (a token whose text
        alone is empty carries no byte and does not count)."""
        with_text = 0
        for i in range(len(s.decoded_ids) - 1, s.read_offset - 1, -1):
            key = (s.decoded_ids[i], s.skip_special_tokens)
            if key not in self._has_text:
                self._has_text[key] = self._decode([key[0]], s.skip_special_tokens) != ""
            if self._has_text[key]:
                with_text += 1
                if with_text == _UNFINISHED_TOKENS:
                    start = i
                elif with_text > _UNFINISHED_TOKENS:
                    return start
        return None

    @staticmethod
    def _commit_text(s: DecodeStatus, text: str, read_offset: int) -> None:
        s.decoded_str += text
        s.surr_offset = s.read_offset
        s.read_offset = read_offset

    def _decode(self, ids: List[int], skip_special_tokens: bool) -> str:
        # a skipped special token adds no text: it is committed with the next token that does
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if ids else ""
