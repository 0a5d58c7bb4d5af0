"""Structured output: ``response_format`` (a JSON schema, or any JSON object) as a token mask, through xgrammar
(the grammar backend SGLang and vLLM use).

A request's schema is compiled once (xgrammar caches compiled grammars), and a matcher follows the request's
tokens: before each step it writes the bitmask of the tokens that keep the output a valid prefix, the sampler sets
every other logit to -inf, and after the step the matcher accepts the sampled token. The output ends when the
grammar is complete (it then allows only EOS). The mask for a step needs the previous step's token, so the
scheduler does not overlap a step with grammar requests with the previous one (``Scheduler.overlap_loop``).

JSON is generated without free whitespace (xgrammar's ``any_whitespace=False``): a small model given the freedom
can emit newlines until ``max_tokens`` runs out (vLLM and SGLang allow any whitespace by default).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any, Dict, List

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# response_format {"type": "json_object"}: any JSON object (what SGLang compiles it to)
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A schema that xgrammar cannot compile, or structured output without xgrammar installed."""


def _xgrammar() -> ModuleType:
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("response_format needs the xgrammar package (pip install xgrammar)") from None
    return xgrammar


def _schema_error(e: Exception) -> GrammarError:
    # xgrammar's C++ errors start with "[time] path/to/file.cc:line: "
    reason = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(e).strip())
    return GrammarError(f"response_format: unsupported JSON schema: {reason}")


class GrammarBackend:
    """Compiled grammars and one matcher per request that has one (keyed by uid). The compiler (importing
    xgrammar and building the tokenizer's table: 3 to 8 s) is built by the first request with a response_format,
    or, in a server, by ``warm_up_in_background`` at start-up: built by that first request it stalled every running
    stream for those seconds."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()  # the warm-up thread and the scheduler build it once between them
        self.warm_up_thread: threading.Thread | None = None
        self.matchers: Dict[int, Any] = {}

    def warm_up_in_background(self) -> bool:
        """Build the compiler on a daemon thread when xgrammar is installed and there is a tokenizer; a request that
        needs it before the thread is done waits for it (no second build). False when there is nothing to build."""
        if self.tokenizer is None or importlib.util.find_spec("xgrammar") is None:
            return False

        def build() -> None:
            try:
                self._get_compiler()
            except Exception as e:  # noqa: BLE001 (a broken install: the first request will say what is wrong)
                logger.warning("response_format warm-up failed: %s", e)

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
                    raise GrammarError("response_format needs the model's tokenizer")
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def add(self, uid: int, schema: str) -> None:
        compiler = self._get_compiler()
        try:
            compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            raise _schema_error(e) from None
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

    def bitmask(self, uids: List[int | None]) -> torch.Tensor:
        """Host int32 bitmask [len(uids), ceil(V / 32)]; rows without a matcher allow every token."""
        xgr = _xgrammar()
        mask = xgr.allocate_token_bitmask(len(uids), self.vocab_size)  # all ones: everything allowed
        for row, uid in enumerate(uids):
            if uid is not None and uid in self.matchers:
                self.matchers[uid].fill_next_token_bitmask(mask, row)
        return mask

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place: -inf for every token the bitmask forbids (bitmask on the logits' device)."""
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask)
