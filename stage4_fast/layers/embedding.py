from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

from ..core import get_global_ctx
from ..distributed import DistributedCommunicator, get_tp_info
from ..kernel import indexing
from ..utils import div_ceil
from .base import BaseOP


class VocabParallelEmbedding(BaseOP):
    """Token embedding split by vocabulary: rank r holds rows [r * ceil(V/tp), ...), ids outside give zero rows,
    the ranks' rows are summed. The last shard is padded with zero rows (upstream loads it short, which fails)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        tp = get_tp_info()
        self.tp_size = tp.size
        self.num_embeddings = num_embeddings
        self.num_embeddings_tp = div_ceil(num_embeddings, tp.size)
        start = tp.rank * self.num_embeddings_tp
        self.vocab_range = (start, max(0, min(self.num_embeddings_tp, num_embeddings - start)))
        self.weight = torch.empty(self.num_embeddings_tp, embedding_dim)
        self._comm = DistributedCommunicator()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return indexing(self.weight, x)
        return self._comm.all_reduce(indexing(self.weight, x, vocab_range=self.vocab_range))


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
            if batch.prompt_logprob_rows is not None:  # echo: the sampler turns these into prompt logprobs
                batch.prompt_hidden = x[batch.prompt_logprob_rows]
            x = x[batch.attn_metadata.get_last_indices(batch.size)]
        return self.compute_logits(x, out=batch.logits_out)

    def warm_up_gemms(self, x: torch.Tensor) -> None:
        """The cuBLAS call of ``compute_logits`` for ``x``'s rows, without communication (``linear.warm_up_gemms``)."""
        weight = self._tied_embedding.weight if self._tied_embedding is not None else self.weight
        F.linear(x, weight, self.bias)

    def compute_logits(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of any rows of final hidden states (the same rows on every rank); into ``out`` when given."""
        weight = self._tied_embedding.weight if self._tied_embedding is not None else self.weight
        if self.tp_size == 1:
            if out is None:
                return F.linear(x, weight, self.bias)
            if self.bias is None:
                return torch.matmul(x, weight.t(), out=out)
            return torch.addmm(self.bias, x, weight.t(), out=out)
        logits = F.linear(x, weight, self.bias)
        # rank-major gather [tp * bs, V_tp] -> [bs, tp * V_tp], then drop the padding rows of the last shard
        bs = logits.shape[0]
        gathered = self._comm.all_gather(logits).view(self.tp_size, bs, self.num_embeddings_tp)
        logits = gathered.transpose(0, 1).reshape(bs, -1)[:, : self.num_embeddings]
        return logits if out is None else out.copy_(logits)
