"""The API's sampling features, batched in ``engine/sample.py``: logprobs (prompt too, for echo), penalties, min-p,
logit bias, and constrained output through xgrammar."""

from .grammar import GrammarBackend, GrammarError
from .logprobs import MAX_TOP_LOGPROBS, BatchLogprobs, LogprobArgs, compute_logprobs
from .processors import LogitBiasArgs, PenaltyArgs, apply_logit_bias, apply_min_p, apply_penalties

__all__ = ["MAX_TOP_LOGPROBS", "BatchLogprobs", "GrammarBackend", "GrammarError", "LogitBiasArgs", "LogprobArgs",
           "PenaltyArgs", "apply_logit_bias", "apply_min_p", "apply_penalties", "compute_logprobs"]
