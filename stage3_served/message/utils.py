"""Explicit serialization of the IPC messages: dataclass <-> plain dict (msgpack-ready).

A message becomes ``{"__type__": ClassName, field: value, ...}``, recursively; a tensor becomes raw bytes plus its
dtype and shape. The ZMQ wrappers (``utils/mp.py``) msgpack the dict. Decoding looks the class name up in a map the
message modules pass in, so only known message types can be built from the wire. A plain dict stays a dict, and
one whose own keys include "__type__" (data a client chose) travels wrapped, ``{"__type__": "__dict__", "items":
{...}}``, so that no key can make the receiver build a message or a tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, Mapping

import torch

_TENSOR = "Tensor"
_TYPE = "__type__"
_DICT = "__dict__"  # a plain dict that has a "__type__" key of its own (its keys are data, e.g. a client's)


def serialize_type(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        # numpy has no bfloat16: ship the raw storage of any dtype as bytes through a uint8 view
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_TYPE: _TENSOR, "buffer": raw, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: Dict[str, Any] = {_TYPE: type(obj).__name__}
        for f in dataclasses.fields(obj):
            if f.init:
                out[f.name] = serialize_type(getattr(obj, f.name))
        return out
    if isinstance(obj, dict):
        items = {k: serialize_type(v) for k, v in obj.items()}
        return {_TYPE: _DICT, "items": items} if _TYPE in obj else items
    if isinstance(obj, (list, tuple)):
        return [serialize_type(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    raise TypeError(f"cannot serialize {type(obj).__name__} in an IPC message")


def _tensor_from(data: Mapping[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, data["dtype"])
    shape = data["shape"]
    if not data["buffer"]:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer wants a writable buffer, and the copy detaches us from msgpack's bytes
    return torch.frombuffer(bytearray(data["buffer"]), dtype=torch.uint8).view(dtype).reshape(shape)


def deserialize_type(cls_map: Mapping[str, type], data: Any) -> Any:
    if isinstance(data, dict):
        name = data.get(_TYPE)
        if name is None:
            return {k: deserialize_type(cls_map, v) for k, v in data.items()}
        if name == _TENSOR:
            return _tensor_from(data)
        if name == _DICT:
            return {k: deserialize_type(cls_map, v) for k, v in data["items"].items()}
        cls = cls_map.get(name)
        if cls is None:
            raise TypeError(f"unknown message type {name!r}")
        return cls(**{k: deserialize_type(cls_map, v) for k, v in data.items() if k != _TYPE})
    if isinstance(data, list):
        return [deserialize_type(cls_map, v) for v in data]
    return data


class Message:
    """The base of one family of messages (one per queue direction): ``encoder`` / ``decoder`` for the ZMQ queues.
    The decoder builds only the classes the family's module lists in ``CLASSES``."""

    CLASSES: ClassVar[Mapping[str, type]] = {}

    def encoder(self) -> Dict[str, Any]:
        return serialize_type(self)

    @classmethod
    def decoder(cls, data: Dict[str, Any]) -> Any:
        return deserialize_type(cls.CLASSES, data)


def by_name(*classes: type) -> Dict[str, type]:
    return {c.__name__: c for c in classes}
