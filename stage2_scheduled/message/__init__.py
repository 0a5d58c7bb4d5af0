"""Messages into and out of the scheduler. Stage 2 passes them as Python objects inside one process (offline
`LLM`); the next stage sends the same dataclasses between processes."""

from .backend import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, ExitMsg, UserMsg
from .tokenizer import BaseTokenizerMsg, BatchTokenizerMsg, DetokenizeMsg

__all__ = ["AbortBackendMsg", "BaseBackendMsg", "BaseTokenizerMsg", "BatchBackendMsg", "BatchTokenizerMsg",
           "DetokenizeMsg", "ExitMsg", "UserMsg"]
