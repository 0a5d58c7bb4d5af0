from __future__ import annotations

from typing import Any, Callable


def div_even(a: int, b: int, allow_replicate: bool = False) -> int:
    """a / b, which must divide exactly; with allow_replicate, b > a (a dividing b: replicated KV heads) gives 1."""
    if allow_replicate and b > a:
        assert b % a == 0, f"{b} is not a multiple of {a}"
        return 1
    assert a % b == 0, f"{a} is not divisible by {b}"
    return a // b


def div_ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


def align_ceil(a: int, b: int) -> int:
    return div_ceil(a, b) * b


def align_down(a: int, b: int) -> int:
    return (a // b) * b


def call_if_main(name: str = "__main__", discard: Any = None) -> Callable[[Callable[[], Any]], Any]:
    """Decorator: run the function right away when the defining module is the entry point."""

    def decorator(fn: Callable[[], Any]) -> Any:
        if name == "__main__":
            fn()
        return discard if discard is not None else fn

    return decorator


class Unset:
    """Sentinel for 'argument not given' where None is a meaningful value."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset()
