"""Structured output as a token mask, through xgrammar (the grammar backend SGLang and vLLM use): a JSON schema
(``response_format``, or any JSON object), a regular expression or an EBNF grammar (SGLang's ``regex`` / ``ebnf``,
vLLM's ``structured_outputs``, which the API server maps onto these three).

A request's grammar is compiled once (xgrammar caches compiled grammars), and a matcher follows the request's
tokens: before each step it writes the bitmask of the tokens that keep the output a valid prefix, the sampler sets
every other logit to -inf, and after the step the matcher accepts the sampled token. The output ends when the
grammar is complete (it then allows only EOS). The mask for a step needs the previous step's token: the scheduler
launches the step's forward, then catches up with the previous step (accepting its tokens) while the device runs
it, and the masks are filled just before the sampler needs them (``Scheduler._forward``, as SGLang's overlap
scheduler does). The rows are filled by xgrammar's batch matcher (threads, no Python loop per row) into one host
buffer kept from step to step (page-locked for a GPU: no allocation and no staging copy per step).

JSON is generated without free whitespace (xgrammar's ``any_whitespace=False``): a small model given the freedom
can emit newlines until ``max_tokens`` runs out (vLLM and SGLang allow any whitespace by default). A request may
allow it (``SamplingParams.json_any_whitespace``, vLLM's ``disable_any_whitespace: false``).
"""

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

# response_format {"type": "json_object"}: any JSON object (what SGLang compiles it to)
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A schema, regular expression or grammar that xgrammar cannot compile, or structured output without xgrammar
    installed."""


def _xgrammar() -> ModuleType:
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("structured output needs the xgrammar package (pip install xgrammar)") from None
    return xgrammar


# what a source that xgrammar cannot compile is called in the error, by kind
_UNSUPPORTED = {"json_schema": "unsupported JSON schema", "regex": "unsupported regular expression",
                "ebnf": "unsupported EBNF grammar", "structural_tag": "unsupported structural tag"}


def _compile_structural_tag(compiler: Any, source: str) -> Any:
    """xgrammar's structural tag (JSON text), or the older form vLLM and SGLang also take: ``{"structures":
    [{"begin", "schema", "end"}], "triggers": [...]}`` (free text until a trigger starts one of the structures)."""
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


def _compile_error(kind: str, e: Exception) -> GrammarError:
    # xgrammar's C++ errors start with "[time] path/to/file.cc:line: "
    reason = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(e).strip())
    return GrammarError(f"{_UNSUPPORTED[kind]}: {reason}")


class GrammarBackend:
    """Compiled grammars and one matcher per request that has one (keyed by uid). The compiler (importing
    xgrammar and building the tokenizer's table: seconds) is built by the first request with structured output,
    or, in a server, by ``warm_up_in_background`` at start-up: built by that first request it would stall every
    running stream for those seconds."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        # The grammars see the tokenizer's ids only. Ids past them (a vocabulary padded for the GPU) have no text:
        # xgrammar would take each for a special token, and its per-token check slows with their number. ``apply``
        # forbids them in a grammar's rows instead.
        self.grammar_vocab = min(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()  # the warm-up thread and the scheduler build it once between them
        self.warm_up_thread: threading.Thread | None = None
        self.matchers: Dict[int, Any] = {}
        self._batch_matcher: Any = None  # xgrammar's BatchGrammarMatcher: fills many rows on its threads
        self._host_mask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, reused by every step
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host_mask (GPU)

    def warm_up_in_background(self) -> bool:
        """Build the compiler on a daemon thread when xgrammar is installed and there is a tokenizer; a request that
        needs it before the thread is done waits for it (no second build). False when there is nothing to build."""
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
        """A matcher for request ``uid``: ``kind`` is json_schema, regex, ebnf or structural_tag
        (``SamplingParams.grammar``); ``json_any_whitespace``: a JSON schema's output may hold free whitespace."""
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
            raise _compile_error(kind, e) from None
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
        """Host int32 bitmask [len(uids), ceil(grammar_vocab / 32)]; rows without a matcher allow every token. A view
        of a buffer that the next call overwrites: copy it first (``device_bitmask`` does)."""
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
        """``bitmask`` on ``device``. On a GPU the host buffer is page-locked and copied without blocking; the next
        call waits for that copy before it writes the buffer again."""
        if device.type != "cuda":
            return self.bitmask(uids).to(device, copy=True)
        if self._copied is not None:
            self._copied.synchronize()
        on_device = self.bitmask(uids, pin_memory=True).to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return on_device

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, grammar_rows: torch.Tensor) -> None:
        """In place: -inf for every token the bitmask forbids (bitmask on the logits' device), and in the rows a
        grammar masks (``grammar_rows``, bool [bs]) for the ids past the tokenizer's."""
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.grammar_vocab)
        if logits.shape[-1] > self.grammar_vocab:
            tail = logits[:, self.grammar_vocab :]
            tail.masked_fill_(grammar_rows[:, None], float("-inf"))
