"""Prompt -> token ids (raw text, chat messages or ids given by the client)."""

from __future__ import annotations

from typing import Dict, List

import torch
from transformers import PreTrainedTokenizerBase


class TokenizeManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def tokenize_one(self, text: str | List[Dict[str, str]] | List[int]) -> torch.Tensor:
        """Host 1-D int32 ids; ValueError for input that cannot become a prompt."""
        if isinstance(text, str):
            # a raw prompt is encoded as transformers does by default (the tokenizer's own special tokens)
            ids = self.tokenizer.encode(text)
        elif text and all(isinstance(m, dict) for m in text):
            if not self.tokenizer.chat_template:
                raise ValueError("this model has no chat template; use /v1/completions with a raw prompt")
            prompt = self.tokenizer.apply_chat_template(text, tokenize=False, add_generation_prompt=True)
            # the template wrote the special tokens (upstream's encode added a second BOS on Llama 3)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif text and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
            ids = list(text)
        else:
            raise ValueError("the prompt must be text, a non-empty list of chat messages or of token ids")
        if len(ids) == 0:
            raise ValueError("the prompt is empty after tokenization")
        return torch.tensor(ids, dtype=torch.int32)
