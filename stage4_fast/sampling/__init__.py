"""The production API's sampling features, applied batched in the sampler (``engine/sample.py``): logprobs (also of
the prompt, for echo), presence / frequency / repetition penalties, min-p, logit bias, and JSON-schema constrained
output through xgrammar."""

from .grammar import GrammarBackend, GrammarError
from .logprobs import MAX_TOP_LOGPROBS, BatchLogprobs, LogprobArgs, compute_logprobs
from .processors import LogitBiasArgs, PenaltyArgs, apply_logit_bias, apply_min_p, apply_penalties

__all__ = [
    "MAX_TOP_LOGPROBS",
    "BatchLogprobs",
    "GrammarBackend",
    "GrammarError",
    "LogitBiasArgs",
    "LogprobArgs",
    "PenaltyArgs",
    "apply_logit_bias",
    "apply_min_p",
    "apply_penalties",
    "compute_logprobs",
]
