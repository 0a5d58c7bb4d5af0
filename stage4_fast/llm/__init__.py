from .llm import LLM, RequestAllFinished, RequestStatus

__all__ = ["LLM", "RequestAllFinished", "RequestStatus"]
