"""Explicit serialization of the IPC messages: dataclass <-> plain dict (msgpack-ready).

A message becomes ``{"__type__": ClassName, field: value, ...}``; a tensor raw bytes, dtype and shape. Decoding
builds only the classes of a map the message modules pass in; a client's dict with a "__type__" key travels wrapped
(``"__dict__"``), so no key can make the receiver build a message or a tensor.

A list of messages of one class travels as columns (``"__columns__"``: one list per field, which msgpack packs in C);
``encoded`` names the columns whose values are not plain, the only ones the receiver walks."""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable, ClassVar, Dict, Mapping, Tuple

import torch

_TENSOR = "Tensor"
_COLUMNS = "__columns__"
_TYPE = "__type__"
_DICT = "__dict__"  # a plain dict that has a "__type__" key of its own (its keys are data, e.g. a client's)
_PLAIN = (bool, int, float, str, bytes, type(None))


@functools.cache
def _init_fields(cls: type) -> Tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


@functools.cache
def _getter(cls: type) -> Callable[[Any], tuple]:
    names = _init_fields(cls)
    if len(names) > 1:
        return operator.attrgetter(*names)
    return lambda v: tuple(getattr(v, name) for name in names)  # attrgetter of one name gives no tuple, of none fails


def _is_message(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


_PLAIN_TYPES = frozenset(_PLAIN)


def _is_plain(values: list) -> bool:
    # the element types collected in C, not a generator: a prompt's ids are checked in one pass
    return _PLAIN_TYPES.issuperset(map(type, values))


def serialize_type(obj: Any) -> Any:
    if type(obj) in _PLAIN:
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        # numpy has no bfloat16: ship the raw storage of any dtype as bytes through a uint8 view
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_TYPE: _TENSOR, "buffer": raw, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if _is_message(obj):
        fields = {name: serialize_type(getattr(obj, name)) for name in _init_fields(type(obj))}
        return {_TYPE: type(obj).__name__, **fields}
    if isinstance(obj, dict):
        items = {k: serialize_type(v) for k, v in obj.items()}
        return {_TYPE: _DICT, "items": items} if _TYPE in obj else items
    if isinstance(obj, (list, tuple)):
        cls = type(obj[0]) if obj else None
        if len(obj) > 1 and _is_message(obj[0]) and all(type(v) is cls for v in obj):
            names = _init_fields(cls)
            # each message's fields as one tuple (attrgetter, in C), then transposed: no getattr per field and message
            fields = dict(zip(names, map(list, zip(*map(_getter(cls), obj)))))
            encoded = [name for name, values in fields.items() if not _is_plain(values)]
            for name in encoded:
                fields[name] = [serialize_type(v) for v in fields[name]]
            return {_TYPE: _COLUMNS, "cls": cls.__name__, "fields": fields, "encoded": encoded}
        if _is_plain(obj):  # a prompt's token ids: msgpack packs the list as it is (one check instead of a call each)
            return obj if type(obj) is list else list(obj)
        return [serialize_type(v) for v in obj]
    if isinstance(obj, (bool, int, float, str, bytes)):  # subclasses (e.g. enums) of the plain types
        return obj
    raise TypeError(f"cannot serialize {type(obj).__name__} in an IPC message")


def _tensor_from(data: Mapping[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, data["dtype"])
    shape = data["shape"]
    if not data["buffer"]:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer wants a writable buffer, and the copy detaches us from msgpack's bytes
    return torch.frombuffer(bytearray(data["buffer"]), dtype=torch.uint8).view(dtype).reshape(shape)


def _rows_from(cls_map: Mapping[str, type], data: Mapping[str, Any]) -> list:
    cls = cls_map.get(data["cls"])
    if cls is None:
        raise TypeError(f"unknown message type {data['cls']!r}")
    fields = dict(data["fields"])
    encoded = data["encoded"]
    if not set(encoded) <= set(fields):
        raise TypeError(f"encoded columns {encoded!r} are not among the fields of {data['cls']!r}")
    for name in encoded:
        fields[name] = [deserialize_type(cls_map, v) for v in fields[name]]
    names = tuple(fields)
    if names == _init_fields(cls):  # the sender's field order: rows built positionally (no dict per row)
        return [cls(*row) for row in zip(*fields.values())]
    return [cls(**dict(zip(names, row))) for row in zip(*fields.values())]


def deserialize_type(cls_map: Mapping[str, type], data: Any) -> Any:
    if isinstance(data, dict):
        name = data.get(_TYPE)
        if name is None:
            return {k: deserialize_type(cls_map, v) for k, v in data.items()}
        if name == _TENSOR:
            return _tensor_from(data)
        if name == _DICT:
            return {k: deserialize_type(cls_map, v) for k, v in data["items"].items()}
        if name == _COLUMNS:
            return _rows_from(cls_map, data)
        cls = cls_map.get(name)
        if cls is None:
            raise TypeError(f"unknown message type {name!r}")
        return cls(**{k: deserialize_type(cls_map, v) for k, v in data.items() if k != _TYPE})
    if isinstance(data, list):
        return data if _is_plain(data) else [deserialize_type(cls_map, v) for v in data]
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
