"""What every request model shares: the error, the strict base that refuses unknown and unimplemented fields,
the bounded integer types and the prompt / stop shapes."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Dict, List, Mapping, Tuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError


class APIError(Exception):
    """An error the client caused (4xx) or a server that cannot answer now (503)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 type: str = "invalid_request_error", headers: Dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type
        self.headers = headers or {}  # e.g. Retry-After on a 503

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# bounds only the loaded model knows; the OpenAPI document fills them in (openapi.py)
BOUND_KEY = "x-bound"
CONTEXT_BOUND = {BOUND_KEY: "context_length"}
VOCAB_BOUND = {BOUND_KEY: "vocab_size"}


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# integers cross processes as int64 / int32: out-of-range ones are refused here, not by an encoder mid-request;
# JSON Schema counts 16.0 as an integer, so it is taken as 16 (not 16.5, "16" or true)
MAX_INT32 = 2**31 - 1
Int32 = Annotated[int, Field(ge=-(2**31), le=MAX_INT32), BeforeValidator(_integral)]
# ±(2^53 - 1): the integers every JSON library reads exactly (many parse numbers as doubles); within int64
SafeInt = Annotated[int, Field(ge=-(2**53 - 1), le=2**53 - 1), BeforeValidator(_integral)]
PromptTokenId = Annotated[int, Field(ge=-(2**31), le=MAX_INT32, json_schema_extra=VOCAB_BOUND),
                          BeforeValidator(_integral)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_INT32, json_schema_extra=CONTEXT_BOUND), BeforeValidator(_integral)]

# unions told apart by their JSON shape, so an error names the branch the value meant
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[List[PromptTokenId], Field(min_length=1)]


def _json_shape(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return "texts" if isinstance(first, str) else "token_id_lists" if isinstance(first, list) else "token_ids"


def _stop_shape(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "list" if isinstance(value, list) else None


Prompt = Annotated[
    Annotated[Text, Tag("text")] | Annotated[TokenIds, Tag("token_ids")]
    | Annotated[List[Text], Field(min_length=1, max_length=1), Tag("texts")]
    | Annotated[List[TokenIds], Field(min_length=1, max_length=1), Tag("token_id_lists")],
    Discriminator(_json_shape, custom_error_type="invalid_prompt",
                  custom_error_message="prompt must be text, token ids, or a list of one of those"),
]
SinglePrompt = Annotated[Annotated[Text, Tag("text")] | Annotated[TokenIds, Tag("token_ids")],
                         Discriminator(_json_shape, custom_error_type="invalid_prompt",
                                       custom_error_message="prompt must be text or token ids")]
Stop = Annotated[
    Annotated[Text, Tag("text")] | Annotated[List[Text], Tag("list")],
    Discriminator(_stop_shape, custom_error_type="invalid_stop",
                  custom_error_message="stop must be a string or a list of strings"),
]


@dataclass(frozen=True)
class NotImplementedField:
    """A request field this server knows but does not implement; ``null`` and ``neutral`` ask for nothing."""

    neutral: Tuple[Any, ...] = ()
    what: str = ""  # what the field would do, for the error message

    def accepts(self, value: Any) -> bool:
        return value is None or any(_same_json(value, n) for n in self.neutral)

    def accepted(self) -> str:
        return ", ".join(json.dumps(v) for v in (None, *self.neutral))

    def json_schema(self) -> Dict[str, Any]:
        return {"enum": [None, *self.neutral],
                "description": f"not implemented ({self.what}); accepted: {self.accepted()}"}


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality: 0 == 0.0, but true is not 1."""
    if type(a) in (int, float) and type(b) in (int, float):  # (JSON values: bool is neither)
        return a == b
    return type(a) is type(b) and a == b


NI = NotImplementedField  # short, for the NOT_IMPLEMENTED_* tables


def add_not_implemented(schema: Dict[str, Any], cls: type) -> None:
    for name, field in getattr(cls, "not_implemented", {}).items():
        schema.setdefault("properties", {})[name] = field.json_schema()


class Strict(BaseModel):
    # strict types; any field that is not declared here or in `not_implemented` is refused by name
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=add_not_implemented)
    not_implemented: ClassVar[Mapping[str, NotImplementedField]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_implemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = [k for k in data if k in cls.not_implemented]
        for name in known:
            field = cls.not_implemented[name]
            if not field.accepts(data[name]):
                raise PydanticCustomError("not_implemented",
                                          "'{param}' is not implemented by this server ({what}); accepted: {accepted}",
                                          {"param": name, "what": field.what, "accepted": field.accepted()})
        return {k: v for k, v in data.items() if k not in known} if known else data


def unknown_field_message(model: type[BaseModel] | None, name: str) -> str:
    known = [*model.model_fields, *getattr(model, "not_implemented", {})] if model is not None else []
    close = difflib.get_close_matches(name, known, n=1)
    return f"unknown parameter {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Dict[str, Any]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
