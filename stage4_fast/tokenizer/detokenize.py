"""Token ids -> text, incrementally per request, never cutting a multi-byte character.

We decode a window ``ids[surr_offset:]`` and commit the text it adds over ``ids[surr_offset:read_offset]`` only when
it does not end in U+FFFD; the last token flushes the rest, so the stream equals decoding all ids at once.

A character is at most 4 bytes, so only the last 3 non-empty tokens can start one that later tokens complete; when
more are held and the text still ends in U+FFFD (no UTF-8), the text before those 3 is committed as decoding all ids
gives it, instead of holding the stream to the end (as vLLM and SGLang do)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

from transformers import PreTrainedTokenizerBase

from ..message import DetokenizeMsg, TextLogprobs, TokenLogprobs, UserReply

_REPLACEMENT = "\ufffd"
# the tokens that can hold an unfinished character's start: a character is at most 4 bytes, a token at least 1
_UNFINISHED_TOKENS = 3


@dataclass
class DecodeStatus:
    decoded_ids: List[int] = field(default_factory=list)
    # text committed and not sent yet (a whole-text str grown by += would be copied at every append)
    unsent: str = ""
    read_offset: int = 0  # ids before this are committed
    surr_offset: int = 0  # start of the left-context window
    completion_tokens: int = 0  # every generated token, the final EOS too (it is not part of the text)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    skip_special_tokens: bool = True  # as the request asked (SamplingParams)


def batch_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[List[List[int]], bool], List[str]]:
    """``(seqs, skip_special_tokens) -> texts``: the Rust ``decode_batch`` unless ``decode`` cleans up spaces."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if hasattr(backend, "decode_batch") and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda seqs, skip: backend.decode_batch(seqs, skip_special_tokens=skip)
    return lambda seqs, skip: [tokenizer.decode(ids, skip_special_tokens=skip) for ids in seqs]


class DetokenizeManager:
    """Works per batch: a step's tokens of every running request are decoded in one tokenizer call."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.decode_map: Dict[int, DecodeStatus] = {}
        self._decode_batch = batch_decoder(tokenizer)
        self._token_text: Dict[int, str] = {}  # token id -> its text alone, for logprobs (at most the vocabulary)
        self._has_text: Dict[Tuple[int, bool], bool] = {}  # (token id, skip_special_tokens) -> decodes to text alone

    def detokenize(self, msgs: List[DetokenizeMsg]) -> List[UserReply]:
        # a batch may hold several steps (the worker drains its queue): one request's messages stay in order
        replies: List[UserReply] = []
        start = 0
        seen: set = set()
        for i, msg in enumerate(msgs):
            if msg.uid in seen:
                replies += self._detokenize_step(msgs[start:i])
                start, seen = i, set()
            seen.add(msg.uid)
        return replies + self._detokenize_step(msgs[start:])

    def detokenize_one(self, msg: DetokenizeMsg) -> UserReply:
        return self._detokenize_step([msg])[0]

    def _detokenize_step(self, msgs: List[DetokenizeMsg]) -> List[UserReply]:
        statuses = [self._record(msg) for msg in msgs]
        pending = [(s, msg.finished) for s, msg in zip(statuses, msgs) if s.read_offset < len(s.decoded_ids)]
        # one tokenizer call per skip_special_tokens value present (usually one)
        for skip in (True, False):
            group = [(s, flush) for s, flush in pending if s.skip_special_tokens == skip]
            if group:
                self._commit(group, skip)
        replies = []
        for s, msg in zip(statuses, msgs):
            new_text, s.unsent = s.unsent, ""
            prompt_lp = msg.prompt_logprobs
            # every generated token's logprobs, the final EOS too (lm-eval counts one per token)
            replies.append(UserReply(
                msg.uid, new_text, msg.finished, msg.finish_reason, s.prompt_tokens, s.completion_tokens,
                s.cached_tokens, msg.error, self._as_text(msg.logprobs) if msg.logprobs is not None else None,
                self._as_text(prompt_lp) if prompt_lp is not None else None,
                self._decode_batch([prompt_lp.token_ids], msg.skip_special_tokens)[0] if prompt_lp else None))
        return replies

    def _commit(self, pending: List[Tuple[DecodeStatus, bool]], skip_special_tokens: bool) -> None:
        """Decode each window with and without its new tokens; commit the text they add unless it ends in half a
        character (``flush``: the last message commits whatever there is)."""
        windows = [s.decoded_ids[s.surr_offset : s.read_offset] for s, _ in pending]
        windows += [s.decoded_ids[s.surr_offset :] for s, _ in pending]
        texts = self._decode_batch(windows, skip_special_tokens)
        held = []  # (status, prefix, text, end) of windows ending in U+FFFD after more tokens than a character needs
        for (s, flush), prefix, text in zip(pending, texts, texts[len(pending) :]):
            if len(text) > len(prefix) and (flush or not text.endswith(_REPLACEMENT)):
                self._commit_text(s, text[len(prefix) :], len(s.decoded_ids))
            elif text.endswith(_REPLACEMENT) and (end := self._unfinished_start(s)) is not None:
                held.append((s, prefix, text, end))
        if held:  # rare (invalid bytes): all but the last tokens' text, where it is the start of the window's
            cuts = self._decode_batch([s.decoded_ids[s.surr_offset : end] for s, _, _, end in held],
                                      skip_special_tokens)
            for (s, prefix, text, end), cut in zip(held, cuts):
                if len(cut) > len(prefix) and cut.startswith(prefix) and text.startswith(cut):
                    self._commit_text(s, cut[len(prefix) :], end)

    def _unfinished_start(self, s: DecodeStatus) -> int | None:
        """Where the held ids' last 3 tokens with text begin when more are held, else None (a token whose text
        alone is empty carries no byte and does not count)."""
        with_text = 0
        for i in range(len(s.decoded_ids) - 1, s.read_offset - 1, -1):
            key = (s.decoded_ids[i], s.skip_special_tokens)
            if key not in self._has_text:
                self._has_text[key] = self._decode_batch([[key[0]]], s.skip_special_tokens)[0] != ""
            if self._has_text[key]:
                with_text += 1
                if with_text == _UNFINISHED_TOKENS:
                    start = i
                elif with_text > _UNFINISHED_TOKENS:
                    return start
        return None

    @staticmethod
    def _commit_text(s: DecodeStatus, text: str, read_offset: int) -> None:
        s.unsent += text
        s.surr_offset = s.read_offset
        s.read_offset = read_offset

    def _as_text(self, lp: TokenLogprobs) -> TextLogprobs:
        return TextLogprobs([self._text_of(t) for t in lp.token_ids], list(lp.logprobs),
                            [[self._text_of(t) for t in top] for top in lp.top_ids], lp.top_logprobs)

    def _text_of(self, token_id: int) -> str:
        """A token's own text, as vLLM reports it (a piece of a multi-byte character decodes to U+FFFD)."""
        if (text := self._token_text.get(token_id)) is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _record(self, msg: DetokenizeMsg) -> DecodeStatus:
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
        return status
