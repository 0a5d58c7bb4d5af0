from .detokenize import DecodeStatus, DetokenizeManager
from .server import tokenize_worker
from .tokenize import TokenizeManager

__all__ = ["DecodeStatus", "DetokenizeManager", "TokenizeManager", "tokenize_worker"]
