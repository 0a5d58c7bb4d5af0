from .activation import silu_and_mul
from .attention import AttentionLayer
from .base import BaseOP, OPList, StateLessOP
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .linear import LinearColParallelMerged, LinearOProj, LinearQKVMerged, LinearReplicated, LinearRowParallel
from .norm import RMSNorm, RMSNormFused
from .rotary import RotaryEmbedding, get_rope, set_rope_device

__all__ = ["AttentionLayer", "BaseOP", "LinearColParallelMerged", "LinearOProj", "LinearQKVMerged", "LinearReplicated",
           "LinearRowParallel", "OPList", "ParallelLMHead", "RMSNorm", "RMSNormFused", "RotaryEmbedding", "StateLessOP",
           "VocabParallelEmbedding", "get_rope", "set_rope_device", "silu_and_mul"]
