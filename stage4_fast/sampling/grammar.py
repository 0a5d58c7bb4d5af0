"""Structured output as a token mask through xgrammar (JSON schema, regex, EBNF, structural tag): a matcher per
request masks tokens that break a valid prefix, filled just before sampling once the scheduler caught up with
the previous step (``Scheduler._forward``). JSON has no free whitespace by default (a small model can emit
newlines until ``max_tokens``); ``SamplingParams.json_any_whitespace`` allows it."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any, Dict, List

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object (as SGLang compiles it)


class GrammarError(ValueError):
    """A source xgrammar cannot compile, or structured output without xgrammar installed."""


def _xgrammar() -> ModuleType:
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("structured output needs the xgrammar package (pip install xgrammar)") from None
    return xgrammar


_UNSUPPORTED = {"json_schema": "unsupported JSON schema", "regex": "unsupported regular expression",
                "ebnf": "unsupported EBNF grammar", "structural_tag": "unsupported structural tag"}


def _compile_structural_tag(compiler: Any, source: str) -> Any:
    """xgrammar's structural tag (JSON), or the older ``{"structures": [{"begin", "schema", "end"}], "triggers"}``."""
    tag = json.loads(source)
    if not (isinstance(tag, dict) and "structures" in tag):
        return compiler.compile_structural_tag(source)
    try:
        items = [_xgrammar().StructuralTagItem(begin=s["begin"], end=s["end"], schema=s["schema"] if isinstance(
            s["schema"], str) else json.dumps(s["schema"])) for s in tag["structures"]]
        triggers = tag["triggers"]
    except (KeyError, TypeError):
        raise ValueError("each of structures needs begin, schema and end, and the tag needs triggers") from None
    return compiler.compile_structural_tag(items, triggers)


class GrammarBackend:
    """A matcher per request with a grammar; a server builds the compiler (seconds) at start-up, in the background."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        # the tokenizer's ids only (padded ids would slow xgrammar as special tokens); ``apply`` forbids the rest
        self.grammar_vocab = min(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()  # the warm-up thread and the scheduler build it once between them
        self.warm_up_thread: threading.Thread | None = None
        self.matchers: Dict[int, Any] = {}
        self._batch_matcher: Any = None  # xgrammar's BatchGrammarMatcher: fills many rows on its threads
        self._host_mask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, reused by every step
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host_mask (GPU)

    def warm_up_in_background(self) -> bool:
        """Build the compiler on a daemon thread (an early request waits for it); False: nothing to build."""
        if self.tokenizer is None or importlib.util.find_spec("xgrammar") is None:
            return False

        def build() -> None:
            try:
                self._get_compiler()
            except Exception as e:  # noqa: BLE001 (a broken install: the first request will say what is wrong)
                logger.warning("structured output warm-up failed: %s", e)

        self.warm_up_thread = threading.Thread(target=build, name="xgrammar-warm-up", daemon=True)
        self.warm_up_thread.start()
        return True

    @property
    def active(self) -> bool:
        return bool(self.matchers)

    def has(self, uid: int) -> bool:
        return uid in self.matchers

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                xgr = _xgrammar()
                if self.tokenizer is None:
                    raise GrammarError("structured output needs the model's tokenizer")
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.grammar_vocab)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def add(self, uid: int, kind: str, source: str, json_any_whitespace: bool = False) -> None:
        """A matcher for request ``uid``; ``kind``: json_schema, regex, ebnf or structural_tag."""
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                compiled = compiler.compile_json_schema(source, any_whitespace=json_any_whitespace)
            elif kind == "regex":
                compiled = compiler.compile_regex(source)
            elif kind == "structural_tag":
                compiled = _compile_structural_tag(compiler, source)
            else:
                compiled = compiler.compile_grammar(source)  # EBNF (GBNF-like), rule "root"
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            reason = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(e).strip())  # C++ errors: "[time] file.cc:line: "
            raise GrammarError(f"{_UNSUPPORTED[kind]}: {reason}") from None
        self.matchers[uid] = _xgrammar().GrammarMatcher(compiled)

    def remove(self, uid: int) -> None:
        self.matchers.pop(uid, None)

    def accept(self, uid: int, token: int) -> bool:
        """Advance the request's matcher; True when its output must end (the grammar is complete)."""
        matcher = self.matchers[uid]
        if not matcher.accept_token(token):  # cannot happen under the mask; end the request rather than go on
            logger.warning("request %d: token %d does not fit its grammar; ending it", uid, token)
            return True
        return matcher.is_terminated()

    def bitmask(self, uids: List[int | None], pin_memory: bool = False) -> torch.Tensor:
        """Host int32 [len(uids), ceil(grammar_vocab / 32)] (no matcher: all allowed), overwritten by the next call."""
        xgr = _xgrammar()
        if self._host_mask is None or self._host_mask.shape[0] < len(uids):
            shape = xgr.get_bitmask_shape(max(len(uids), 64), self.grammar_vocab)
            self._host_mask = torch.empty(shape, dtype=torch.int32, pin_memory=pin_memory)
            self._batch_matcher = self._batch_matcher or xgr.BatchGrammarMatcher()  # xgrammar's default threads
        mask = self._host_mask[: len(uids)]
        matchers, rows = [], []
        for row, uid in enumerate(uids):
            matcher = self.matchers.get(uid) if uid is not None else None
            if matcher is None:
                mask[row] = -1  # all ones: everything allowed
            else:
                matchers.append(matcher)
                rows.append(row)
        if matchers:  # each filled row is written whole
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, mask, rows)
        return mask

    def device_bitmask(self, uids: List[int | None], device: torch.device) -> torch.Tensor:
        """``bitmask`` on ``device``; on a GPU copied without blocking, the next call waiting for that copy."""
        if device.type != "cuda":
            return self.bitmask(uids).to(device, copy=True)
        if self._copied is not None:
            self._copied.synchronize()
        on_device = self.bitmask(uids, pin_memory=True).to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return on_device

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, grammar_rows: torch.Tensor) -> None:
        """In place: -inf where the bitmask forbids, and past the tokenizer's ids in ``grammar_rows`` (bool [bs])."""
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.grammar_vocab)
        if logits.shape[-1] > self.grammar_vocab:
            logits[:, self.grammar_vocab :].masked_fill_(grammar_rows[:, None], float("-inf"))
