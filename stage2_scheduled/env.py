"""Environment switches, read from MINISGL_<NAME> (as upstream)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default_value: T
    fn: Callable[[str], T]

    @property
    def value(self) -> T:
        # Read on every access (upstream reads once at import) so a test can flip it with monkeypatch.setenv.
        raw = os.getenv(f"MINISGL_{self.name}")
        if raw is None:
            return self.default_value
        try:
            return self.fn(raw)
        except ValueError:
            return self.default_value


def _parse_bool(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes")


class _Env:
    DISABLE_OVERLAP_SCHEDULING = EnvVar("DISABLE_OVERLAP_SCHEDULING", False, _parse_bool)
    # the idle KV check walks the whole prefix cache (slow at a million tokens): off by default, on in the test suites
    CHECK_CACHE_DEEP = EnvVar("CHECK_CACHE_DEEP", False, _parse_bool)


ENV = _Env()
