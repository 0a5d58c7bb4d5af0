from __future__ import annotations

import argparse
from typing import Callable, Dict, Generic, Iterable, List, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> item table for pluggable parts (model architectures, attention backends)."""

    def __init__(self, type: str) -> None:
        self._type = type
        self._items: Dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], None]:
        def decorator(item: T) -> None:  # like upstream, the decorated name becomes None: use the registry
            assert name not in self._items, f"{self._type} {name!r} registered twice"
            self._items[name] = item

        return decorator

    def __getitem__(self, name: str) -> T:
        if name not in self._items:
            raise KeyError(f"unknown {self._type} {name!r}; supported: {self.supported_names()}")
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def supported_names(self) -> List[str]:
        return list(self._items)

    def assert_supported(self, names: Iterable[str]) -> None:
        for name in names:
            if name not in self._items:
                raise argparse.ArgumentTypeError(f"unsupported {self._type} {name!r}; "
                                                 f"supported: {self.supported_names()}")
