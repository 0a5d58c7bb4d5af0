"""Messages between the server's processes: typed dataclasses, each family with an ``encoder`` / ``decoder`` pair
(``utils.py``) that the ZMQ queues msgpack. The offline `LLM` passes the same objects in-process."""

from .backend import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, ExitMsg, StatsBackendMsg, UserMsg
from .frontend import BaseFrontendMsg, BatchFrontendMsg, StatsReply, UserReply
from .logprobs import TextLogprobs, TokenLogprobs
from .tokenizer import (
    AbortMsg,
    BaseTokenizerMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    StatsMsg,
    StatsQueryMsg,
    TokenColumnsMsg,
    TokenizeMsg,
    expand_columns,
)

__all__ = ["AbortBackendMsg", "AbortMsg", "BaseBackendMsg", "BaseFrontendMsg", "BaseTokenizerMsg", "BatchBackendMsg",
           "BatchFrontendMsg", "BatchTokenizerMsg", "DetokenizeMsg", "ExitMsg", "StatsBackendMsg", "StatsMsg",
           "StatsQueryMsg", "StatsReply", "TextLogprobs", "TokenColumnsMsg", "TokenLogprobs", "TokenizeMsg", "UserMsg",
           "UserReply", "expand_columns"]
