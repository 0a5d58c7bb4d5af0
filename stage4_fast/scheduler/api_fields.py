"""The API fields on the scheduler's side: admission checks the API server cannot make, and the logprobs of the sampled
tokens and of an echoed prompt (collected chunk by chunk)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List

from ..core import Batch, Req
from ..message import TokenLogprobs, UserMsg
from ..sampling import MAX_TOP_LOGPROBS, BatchLogprobs, LogprobArgs

if TYPE_CHECKING:
    from ..engine import Engine


class ApiFieldsMixin:
    engine: Engine
    _prompt_logprobs: Dict[int, TokenLogprobs]  # uid -> the prompt logprobs of the chunks prefilled so far

    def _is_stale(self, req: Req) -> bool:
        raise NotImplementedError

    def _check_api_fields(self, msg: UserMsg) -> str | None:
        """logit_bias ids against the vocabulary, and the API's bounds again for the offline LLM's callers."""
        params, vocab_size = msg.sampling_params, self.engine.config.model_config.vocab_size
        if any(not 0 <= int(tid) < vocab_size for tid, _ in params.logit_bias):
            return f"logit_bias token ids must be in [0, {vocab_size})"
        if params.logprobs is not None and not 0 <= params.logprobs <= MAX_TOP_LOGPROBS:
            return f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {params.logprobs}"
        if not 0.01 <= params.repetition_penalty <= 10.0:  # as the API's bounds
            return f"repetition_penalty must be in [0.01, 10], got {params.repetition_penalty}"
        return None

    def _token_logprobs(self, batch: Batch, tokens: List[int], args: LogprobArgs | None,
                        logprobs: BatchLogprobs | None) -> Dict[int, TokenLogprobs]:
        """Batch row -> its sampled token's logprobs; echo chunks' prompt logprobs go to ``_prompt_logprobs``."""
        if args is None or logprobs is None:
            return {}
        out: Dict[int, TokenLogprobs] = {}
        values, top_ids, top_values = (logprobs.token_logprobs.tolist(), logprobs.top_ids.tolist(),
                                       logprobs.top_logprobs.tolist())
        for j, i in enumerate(args.rows_host):
            k = batch.reqs[i].sampling_params.logprobs
            out[i] = TokenLogprobs([tokens[i]], [values[j]], [top_ids[j][:k]], [top_values[j][:k]])
        if args.prompt_segments:
            p_values, p_ids, p_top = (logprobs.prompt_token_logprobs.tolist(), logprobs.prompt_top_ids.tolist(),
                                      logprobs.prompt_top_logprobs.tolist())
            for i, start, count in args.prompt_segments:
                req = batch.reqs[i]
                if self._is_stale(req):
                    continue
                k, end = req.sampling_params.logprobs, start + count
                acc = self._prompt_logprobs.setdefault(req.uid, TokenLogprobs())
                acc.extend(TokenLogprobs([], p_values[start:end], [t[:k] for t in p_ids[start:end]],
                                         [t[:k] for t in p_top[start:end]]))
        return out

    def _echoed_prompt(self, req: Req) -> TokenLogprobs:
        """The prompt's ids for echo, with its chunks' logprobs if asked (the first token's is None)."""
        ids = req.input_ids.tolist()
        acc = self._prompt_logprobs.pop(req.uid, None)
        if not req.sampling_params.wants_prompt_logprobs:
            return TokenLogprobs(ids, [None] * len(ids), [[] for _ in ids], [[] for _ in ids])
        acc = acc or TokenLogprobs()
        assert len(acc.logprobs) == len(ids) - 1, (len(acc.logprobs), len(ids))
        return TokenLogprobs(ids, [None, *acc.logprobs], [[], *acc.top_ids], [[], *acc.top_logprobs])
