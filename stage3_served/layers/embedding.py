from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

from ..core import get_global_ctx
from ..distributed import get_tp_info
from ..utils import div_ceil
from .base import BaseOP


class VocabParallelEmbedding(BaseOP):
    """Token embedding; with tp ranks each holds a contiguous vocab range (tp = 1 in stage1: the whole table)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        tp = get_tp_info()
        self.tp_size = tp.size
        self.num_embeddings = num_embeddings
        self.num_embeddings_tp = div_ceil(num_embeddings, tp.size)
        start = tp.rank * self.num_embeddings_tp
        self.vocab_range = (start, min(self.num_embeddings_tp, num_embeddings - start))
        self.weight = torch.empty(self.num_embeddings_tp, embedding_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, tie_word_embeddings: bool = False,
                 tied_embedding: VocabParallelEmbedding | None = None):
        assert (tied_embedding is not None) == tie_word_embeddings, "give tied_embedding iff tie_word_embeddings"
        super().__init__(num_embeddings, embedding_dim)
        self.bias = torch.empty(self.num_embeddings_tp) if bias else None
        self._tied_embedding = tied_embedding  # private: its weight belongs to (and is loaded by) embed_tokens
        if tied_embedding is not None:
            del self.weight

    def state_dict(self, *, prefix: str = "", result: Dict[str, torch.Tensor] | None = None) -> Dict[str, torch.Tensor]:
        if self._tied_embedding is not None:
            return {} if result is None else result
        return super().state_dict(prefix=prefix, result=result)

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor], *, prefix: str = "",
                        _internal: bool = False) -> None:
        if self._tied_embedding is not None:
            # some tied checkpoints still store a copy of the head: it is the embedding, drop it
            state_dict.pop(f"{prefix}.weight", None)
            state_dict.pop(f"{prefix}.bias", None)
            if not _internal and state_dict:
                raise RuntimeError(f"unexpected weights: {sorted(state_dict)[:8]}")
            return
        super().load_state_dict(state_dict, prefix=prefix, _internal=_internal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = get_global_ctx().batch
        if batch.is_prefill:  # only each request's last position produces a token
            x = x[batch.attn_metadata.get_last_indices(batch.size)]
        weight = self._tied_embedding.weight if self._tied_embedding is not None else self.weight
        return F.linear(x, weight, self.bias)
