from .misc import UNSET, Unset, align_ceil, align_down, call_if_main, div_ceil, div_even
from .registry import Registry
from .torch_utils import int_tensor, torch_dtype

__all__ = ["UNSET", "Unset", "Registry", "align_ceil", "align_down", "call_if_main", "div_ceil", "div_even",
           "int_tensor", "torch_dtype"]
