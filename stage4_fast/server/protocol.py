"""OpenAI-compatible request models and errors.

The models are strict (``"16"`` is not an int, ``1`` is not a bool) and their bounds are in the schema, so
FastAPI's OpenAPI document says exactly what is accepted. Everything that fails validation becomes an OpenAI-style
error body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (see ``api_server``).

The models are the one declaration of what each endpoint implements: a field that is not one of a model's fields is
refused with a 400 that names it, never ignored. OpenAI's fields (and the common vLLM/SGLang extras) that are known
but not implemented are listed in ``NOT_IMPLEMENTED_*`` below with the values that ask for nothing (``"n": 1``,
``"logprobs": false``), which are accepted. Implementing one = deleting its line there and adding a typed field to
the model.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Mapping, Tuple, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from ..sampling.grammar import JSON_OBJECT_SCHEMA
from ..sampling.logprobs import MAX_TOP_LOGPROBS


class APIError(Exception):
    """An error the client caused (4xx) or a server that cannot answer now (503)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 type: str = "invalid_request_error", headers: Dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type
        self.headers = headers or {}  # e.g. Retry-After on a 503

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Bounds that only the loaded model knows; the OpenAPI document fills them in (openapi.py). The API refuses a
# max_tokens beyond the context itself, the scheduler a prompt token id outside the vocabulary (a 400 either way).
BOUND_KEY = "x-bound"
CONTEXT_BOUND = {BOUND_KEY: "context_length"}
VOCAB_BOUND = {BOUND_KEY: "vocab_size"}



def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Integers cross process boundaries as msgpack int64 / torch int32: out-of-range ones must be refused here, not by
# an encoder half-way through a request (found by the schema fuzzer). JSON Schema counts 16.0 as an integer, so the
# strict models take it as 16 (but not 16.5, "16" or true); the bounds come first so that the schema states them.
MAX_INT32 = 2**31 - 1
Int32 = Annotated[int, Field(ge=-(2**31), le=MAX_INT32), BeforeValidator(_integral)]
# ±(2^53 - 1): the integers every JSON library reads exactly (many parse numbers as doubles); within int64
SafeInt = Annotated[int, Field(ge=-(2**53 - 1), le=2**53 - 1), BeforeValidator(_integral)]
# a chat template variable: a JSON scalar whose integers the wire carries (a larger one is read as a number, as
# JSON readers that parse numbers as doubles do), or a list or object of them (templates take switches and names;
# nothing deeper is accepted)
JSONScalar = Union[str, bool, SafeInt, float, None]
TemplateValue = Union[JSONScalar, List[JSONScalar], Dict[str, JSONScalar]]
PromptTokenId = Annotated[int, Field(ge=-(2**31), le=MAX_INT32, json_schema_extra=VOCAB_BOUND),
                          BeforeValidator(_integral)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_INT32, json_schema_extra=CONTEXT_BOUND), BeforeValidator(_integral)]
MinTokens = Annotated[int, Field(ge=0, le=MAX_INT32), BeforeValidator(_integral)]

# Stage 4 (production API): how many choices one request may ask for (OpenAI's limit on n); n times the number of
# prompts, each choice being one engine request
MAX_CHOICES = 128
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES), BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
BiasedTokenId = Annotated[str, Field(pattern=r"^[0-9]+$")]  # a token id as a JSON object key

# Prompts and stop strings: unions told apart by their JSON shape, so an error names the branch the value meant
# (`prompt.token_ids: List should have at least 1 item`) and the schema states the same constraints (oneOf).
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
    | Annotated[List[Text], Field(min_length=1, max_length=MAX_CHOICES), Tag("texts")]
    | Annotated[List[TokenIds], Field(min_length=1, max_length=MAX_CHOICES), Tag("token_id_lists")],
    Discriminator(_json_shape, custom_error_type="invalid_prompt",
                  custom_error_message="prompt must be text, token ids, or a list of those"),
]
SinglePrompt = Annotated[
    Annotated[Text, Tag("text")] | Annotated[TokenIds, Tag("token_ids")],
    Discriminator(_json_shape, custom_error_type="invalid_prompt",
                  custom_error_message="prompt must be text or token ids"),
]
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
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


_NI = NotImplementedField
# what both completion endpoints know but do not implement
NOT_IMPLEMENTED_SAMPLING: Dict[str, NotImplementedField] = {
    # SGLang's own fields, which its router (sglang-router) adds to every request at these values
    "no_stop_trim": _NI((False,), "keeping the stop string"),
    "return_hidden_states": _NI((False,), "hidden states in the response"),
}
NOT_IMPLEMENTED_CHAT: Dict[str, NotImplementedField] = {
    **NOT_IMPLEMENTED_SAMPLING,
    "functions": _NI(([],), "function calls"),
    "function_call": _NI(("none",), "function calls"),
    "modalities": _NI((["text"],), "output other than text"),
    "audio": _NI((), "audio output"),
    "prediction": _NI((), "predicted outputs"),
    "reasoning_effort": _NI((), "reasoning effort"),
    "web_search_options": _NI((), "web search"),
}
NOT_IMPLEMENTED_COMPLETION: Dict[str, NotImplementedField] = {
    **NOT_IMPLEMENTED_SAMPLING,
    "best_of": _NI((1,), "best-of sampling"),
    "suffix": _NI((), "insertion"),
}


def _add_not_implemented(schema: Dict[str, Any], cls: type) -> None:
    # the OpenAPI document lists them too, with the only values accepted, so it tells the truth about them
    for name, field in getattr(cls, "not_implemented", {}).items():
        schema.setdefault("properties", {})[name] = field.json_schema()


class _Strict(BaseModel):
    # strict types; any field that is not declared here or in `not_implemented` is refused by name
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_add_not_implemented)
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
                raise PydanticCustomError(
                    "not_implemented", "'{param}' is not implemented by this server ({what}); accepted: {accepted}",
                    {"param": name, "what": field.what, "accepted": field.accepted()},
                )
        return {k: v for k, v in data.items() if k not in known} if known else data


def unknown_field_message(model: type[BaseModel] | None, name: str) -> str:
    """The message for a field no model of this endpoint declares (a typo, or a field nobody has heard of)."""
    message = f"unknown parameter {name!r}"
    if model is not None:
        close = difflib.get_close_matches(name, [*model.model_fields, *getattr(model, "not_implemented", {})], n=1)
        if close:
            message += f" (did you mean {close[0]!r}?)"
    return message


class TextPart(_Strict):
    type: Literal["text"]
    text: str


Content = str | List[TextPart]


def _text(content: Content | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="JSON text")


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class SystemOrUserMessage(_Strict):
    role: Literal["system", "user"]
    content: Content

    def for_template(self) -> Dict[str, Any]:
        return {"role": self.role, "content": _text(self.content)}


def _assistant_rules(schema: Dict[str, Any], cls: type) -> None:
    # the schema states the rule _check_content enforces: content, or tool calls
    # (no "type": "array" of its own: a schema fuzzer would draw that array's items from any JSON value, where the
    # field's own schema names them)
    schema["anyOf"] = [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                       {"required": ["tool_calls"], "properties": {"tool_calls": {"not": {"type": "null"},
                                                                                  "minItems": 1}}}]


class AssistantMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_assistant_rules)
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: List[ToolCall] | None = Field(None, description="the calls this turn made (content may be null)")

    @model_validator(mode="after")
    def _check_content(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def for_template(self) -> Dict[str, Any]:
        message: Dict[str, Any] = {"role": "assistant", "content": _text(self.content)}
        if self.tool_calls:
            # chat templates write the arguments as JSON themselves (`| tojson`): they get the object, as vLLM
            # hands them
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(description="the call this message answers")

    def for_template(self) -> Dict[str, Any]:
        return {"role": "tool", "content": _text(self.content), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[SystemOrUserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule
    description: str | None = None
    parameters: Dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM extension: every chunk carries its choice's "
                                                            "usage so far")


class JSONSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: Dict[str, Any] = Field(alias="schema", description="the JSON schema the output must match")
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


class TaggedStructure(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    begin: str = Field(min_length=1, description="the text that opens the structure (starts with a trigger)")
    schema_: Dict[str, Any] = Field(alias="schema", description="the JSON schema of what comes between")
    end: str = Field(description="the text that closes it")


class StructuralTagResponseFormat(_Strict):
    """SGLang's and vLLM's structural tag: free text until one of ``triggers``, then one of ``structures``."""

    type: Literal["structural_tag"]
    structures: List[TaggedStructure] = Field(min_length=1)
    triggers: List[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, description="each structure's begin starts with one of them")

    @model_validator(mode="after")
    def _check_triggers(self) -> StructuralTagResponseFormat:
        for s in self.structures:  # (xgrammar's own refusal of it is an internal check's message)
            if not any(s.begin.startswith(t) for t in self.triggers):
                raise ValueError(f"the structure that begins {s.begin!r} starts with none of the triggers")
        return self

    def source(self) -> str:
        """As ``SamplingParams.structural_tag`` (xgrammar's older form, sampling/grammar.py)."""
        return json.dumps({"structures": [{"begin": s.begin, "schema": s.schema_, "end": s.end}
                                          for s in self.structures], "triggers": self.triggers})


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaResponseFormat | StructuralTagResponseFormat,
                           Field(discriminator="type")]


def _structured_outputs_rules(schema: Dict[str, Any], cls: type) -> None:
    _add_not_implemented(schema, cls)
    # the schema states the rule _check_one enforces: one of the five non-null (json_object null or false), or
    # json_object true and the five null
    null, names = {"type": "null"}, ["json", "regex", "choice", "grammar", "structural_tag"]
    schema["anyOf"] = [
        *({"required": [name], "properties": {**{other: null for other in names if other != name},
                                              name: {"not": null}, "json_object": {"anyOf": [null, {"const": False}]}}}
          for name in names),
        {"required": ["json_object"], "properties": {**{name: null for name in names}, "json_object": {"const": True}}},
    ]


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True,
                              json_schema_extra=_structured_outputs_rules)

    not_implemented: ClassVar[Mapping[str, NotImplementedField]] = {
        "whitespace_pattern": _NI((), "a pattern for JSON's whitespace"),
    }
    json_: Dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (an object, or JSON "
                                                                             "text)")
    regex: str | None = Field(None, description="a regular expression")
    choice: List[str] | None = Field(None, min_length=1, description="the output is one of these strings")
    grammar: str | None = Field(None, description="an EBNF grammar (xgrammar's dialect, rule root)")
    json_object: bool | None = Field(None, description="true: any JSON object")
    structural_tag: str | None = Field(None, description="a structural tag (JSON text: xgrammar's format, or "
                                                         "{structures: [{begin, schema, end}], triggers})")
    disable_any_whitespace: bool | None = Field(None, description="false: JSON output may hold free whitespace "
                                                                  "between its tokens (vLLM's default); true or "
                                                                  "null: it holds none (this server's default)")

    @model_validator(mode="after")
    def _check_one(self) -> StructuredOutputs:
        if len(self.constraints()) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, structural_tag, json_object: true")
        return self

    def constraints(self) -> List[str]:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "structural_tag": self.structural_tag}
        return [name for name, value in given.items() if value is not None] + (["json_object"] if self.json_object
                                                                               else [])

    def grammar_source(self) -> Tuple[str, str]:
        """As (kind, source) of ``SamplingParams.grammar``: a choice becomes the grammar of its alternatives."""
        if self.json_ is not None:
            return "json_schema", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:  # (JSON's string escapes are the grammar's: quotes, backslashes, \n, \uXXXX)
            return "ebnf", "root ::= " + " | ".join(json.dumps(c) for c in self.choice)
        if self.grammar is not None:
            return "ebnf", self.grammar
        if self.structural_tag is not None:
            return "structural_tag", self.structural_tag
        return "json_schema", JSON_OBJECT_SCHEMA


# the request fields that ask for structured output, of which a request gives one at most
STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "json_schema", "regex", "ebnf")
_ONE_OF_THEM = "; at most one of response_format (json), structured_outputs, json_schema, regex, ebnf"


def _sampling_request_rules(schema: Dict[str, Any], cls: type) -> None:
    _add_not_implemented(schema, cls)
    # pydantic writes a dict with a key pattern as patternProperties alone, which lets any other key through
    next(s for s in schema["properties"]["logit_bias"]["anyOf"] if s.get("type") == "object")[
        "additionalProperties"] = False
    # One rule is left out: at most one of STRUCTURED_OUTPUT_FIELDS. Spelled as conditionals (one per field, or
    # dependentSchemas), it leaves the chat body past what schemathesis' schema engine models (it refuses to
    # generate for it); the fields' descriptions say it, and the tests' schemathesis hooks keep to it.


class SamplingFields(_Strict):
    """What /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_sampling_request_rules)

    model: str | None = Field(None, description="must name the served model when given")
    max_tokens: MaxTokens | None = Field(None, description="new tokens at most (default: the rest of the context)")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int32 = Field(-1, description="< 1 disables top-k")
    seed: SafeInt | None = Field(None, description="per-request sampling seed")
    stop: Stop | None = Field(None, description="the text is cut before the first occurrence")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: the text ends with the stop "
                                                               "string that ended it")
    min_tokens: MinTokens = Field(0, description="vLLM extension: EOS, stop_token_ids and stop strings cannot end "
                                                   "the output before it has this many tokens (a stop string that "
                                                   "ends after them counts)")
    stop_token_ids: List[Int32] | None = Field(None, description="token ids that end the request like EOS")
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(True, description="leave special tokens (e.g. <|im_end|>) out of the text")
    user: str | None = Field(None, description="the client's id of its end user (OpenAI's): shown in the request "
                                               "log (--enable-log-requests)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # stage 4, the production API (vLLM's semantics where OpenAI says nothing)
    n: Choices = Field(1, description="samples per prompt; with a seed, sample j uses seed + j")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # (far below 0.01, float32 would overflow dividing by it)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0, description="vLLM / SGLang extension; 1 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM / SGLang extension; 0 = off")
    logit_bias: Dict[BiasedTokenId, Bias] | None = Field(
        None, description="token id (as a string) -> bias added to its logit; ids beyond the vocabulary are a 400")
    response_format: ResponseFormat | None = Field(
        None, description="json_object, json_schema or structural_tag (SGLang / vLLM: free text until a trigger, "
                          "then a structure), through xgrammar; one it cannot compile is a 400"
                          + _ONE_OF_THEM)
    # the other ways vLLM and SGLang ask for structured output
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension" + _ONE_OF_THEM)
    json_schema: str | None = Field(None, description="SGLang extension: a JSON schema, as JSON text" + _ONE_OF_THEM)
    regex: str | None = Field(None, description="SGLang extension: the output matches this regular expression"
                                                + _ONE_OF_THEM)
    ebnf: str | None = Field(None, description="SGLang extension: an EBNF grammar (xgrammar's dialect, rule root)"
                                               + _ONE_OF_THEM)

    def logit_bias_list(self) -> List[Tuple[int, float]]:
        return [(int(k), float(v)) for k, v in (self.logit_bias or {}).items()]

    def grammar(self) -> Dict[str, Any]:
        """The structured output asked for, as ``SamplingParams``' field (json_schema, regex, ebnf or structural_tag)
        -> source, with json_any_whitespace where a JSON output may hold free whitespace; empty for free text."""
        fmt, outputs = self.response_format, self.structured_outputs
        if isinstance(fmt, JSONSchemaResponseFormat):
            return {"json_schema": json.dumps(fmt.json_schema.schema_)}
        if isinstance(fmt, JSONObjectFormat):
            return {"json_schema": JSON_OBJECT_SCHEMA}
        if isinstance(fmt, StructuralTagResponseFormat):
            return {"structural_tag": fmt.source()}
        if outputs is not None:
            kind, source = outputs.grammar_source()
            free_whitespace = kind == "json_schema" and outputs.disable_any_whitespace is False
            return {kind: source, **({"json_any_whitespace": True} if free_whitespace else {})}
        return {kind: source for kind, source in (("json_schema", self.json_schema), ("regex", self.regex),
                                                  ("ebnf", self.ebnf)) if source is not None}

    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @model_validator(mode="after")
    def _check_one_grammar(self) -> SamplingFields:
        asked = [name for name in STRUCTURED_OUTPUT_FIELDS if getattr(self, name) is not None]
        if isinstance(self.response_format, TextFormat):
            asked.remove("response_format")  # free text: no constraint
        if len(asked) > 1:
            raise ValueError(f"only one way to ask for structured output per request: {', '.join(asked)} given")
        return self


# apply_chat_template's own parameters (transformers' PreTrainedTokenizerBase.apply_chat_template) and the names it
# renders the template with: chat_template_kwargs sets the template's other variables, not these
CHAT_TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def _template_rules(schema: Dict[str, Any]) -> None:
    # the schema states the rules ChatTemplateFields enforces: add_generation_prompt and continue_final_message not
    # both true (vLLM's), no template-call parameter among the kwargs
    both = ["add_generation_prompt", "continue_final_message"]
    schema["not"] = {"properties": {name: {"const": True} for name in both}, "required": both}
    kwargs = schema["properties"]["chat_template_kwargs"]["anyOf"][0]
    kwargs["propertyNames"] = {"not": {"enum": sorted(CHAT_TEMPLATE_RESERVED)}}


def _chat_request_rules(schema: Dict[str, Any], cls: type) -> None:
    _sampling_request_rules(schema, cls)
    _template_rules(schema)
    # top_logprobs only with logprobs (OpenAI's and vLLM's)
    schema["if"] = {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]}
    schema["then"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}


class ChatTemplateFields(_Strict):
    """What renders chat messages into a prompt: vLLM's and SGLang's chat template options, and the tools."""

    add_generation_prompt: bool | None = Field(
        None, description="end the prompt with the template's assistant header (default: true, unless "
                          "continue_final_message)")
    continue_final_message: bool = Field(
        False, description="leave the last message open: the model continues it (e.g. an assistant's prefix)")
    chat_template_kwargs: Dict[str, TemplateValue] | None = Field(
        None, description="more variables for the model's chat template, e.g. {\"enable_thinking\": false} for "
                          "Qwen3")
    tools: List[Tool] | None = Field(None, description="functions the model may call (the chat template renders "
                                                       "them; a template that does not is a 400)")

    @model_validator(mode="after")
    def _check_template_options(self) -> ChatTemplateFields:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        reserved = sorted(CHAT_TEMPLATE_RESERVED.intersection(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {reserved[0]!r} (a parameter of the template call; "
                             f"use the request field where there is one)")
        return self

    def tool_dicts(self) -> List[Dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def chat_options(self) -> Dict[str, Any] | None:
        """The chat template's keyword arguments beyond the default (None: add_generation_prompt=True only). Tools
        go to the template whatever the tool_choice (vLLM's default, none included)."""
        add = self.add_generation_prompt
        if add is None:
            add = not self.continue_final_message
        if add and not self.continue_final_message and not self.chat_template_kwargs and not self.tools:
            return None
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": add,
                "continue_final_message": self.continue_final_message,
                **({"tools": self.tool_dicts()} if self.tools else {})}


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_chat_request_rules)
    not_implemented: ClassVar[Mapping[str, NotImplementedField]] = NOT_IMPLEMENTED_CHAT
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = Field(None, description="newer name of max_tokens")
    logprobs: bool = Field(False, description="the logprob of every output token")
    top_logprobs: TopLogprobs | None = Field(None, description="and of the most likely ones (needs logprobs)")
    # SGLang's (sglang-router sends them): what --reasoning-parser does with a thinking block (nothing without one)
    separate_reasoning: bool = Field(True, description="SGLang extension: the thinking block goes to "
                                                       "reasoning_content (false: it stays in the content)")
    stream_reasoning: bool = Field(True, description="SGLang extension: false sends the reasoning whole once it "
                                                     "ends")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools (needs --tool-call-parser), none without; required or a named "
                          "tool hold the output to calls (JSON)")
    parallel_tool_calls: bool = Field(True, description="false: at most one tool call (required holds the "
                                                        "output to one; auto keeps the first)")

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice other than none needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if self.forced_tool() and self.grammar():
            raise ValueError("tool_choice required or a named tool holds the output to JSON already: no other "
                             "structured output with it")
        return self

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: auto when there are tools, none otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def forced_tool(self) -> bool:
        """Whether the output is held to tool calls (required, or a named tool)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    not_implemented: ClassVar[Mapping[str, NotImplementedField]] = NOT_IMPLEMENTED_COMPLETION
    prompt: Prompt = Field(description="text or token ids, or a list of prompts (each gets n choices, in order; n "
                                       f"times their number is at most {MAX_CHOICES})")
    max_tokens: MaxTokens | None = 16
    echo: bool = Field(False, description="the prompt comes back in front of the output (and in the logprobs)")
    logprobs: TopLogprobs | None = Field(None, description="the logprob of every token and of this many likeliest")

    @model_validator(mode="after")
    def _check_choices(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"n times the number of prompts must be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> List[str | List[int]]:
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


class GenerateRequest(_Strict):
    """Upstream's /generate: greedy, streamed."""

    prompt: SinglePrompt
    max_tokens: MaxTokens
    ignore_eos: bool = False
    stream: bool = True


def _tokenize_rules(schema: Dict[str, Any], cls: type) -> None:
    _template_rules(schema)
    # the schema states the rule _check_input enforces: a prompt (its add_special_tokens), or messages (the
    # template's options)
    null = {"type": "null"}
    schema["anyOf"] = [  # (the fields' own schemas name their types: see _assistant_rules)
        {"required": ["prompt"], "properties": {
            "prompt": {"not": null}, "messages": null, "add_generation_prompt": null,
            "continue_final_message": {"const": False}, "chat_template_kwargs": null, "tools": null}},
        {"required": ["messages"], "properties": {"prompt": null, "messages": {"not": null},
                                                  "add_special_tokens": null}},
    ]


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt as the tokenizer encodes it, or chat messages as the chat template renders them
    (the prompt /v1/chat/completions would run)."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_tokenize_rules)
    model: str | None = Field(None, description="must name the served model when given")
    prompt: str | None = None
    messages: List[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="a prompt's: the tokenizer's own special tokens, "
                                                              "e.g. BOS (default true)")

    @model_validator(mode="after")
    def _check_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt or messages")
        template = (self.add_generation_prompt, self.chat_template_kwargs, self.tools)
        if self.prompt is not None and (any(option is not None for option in template) or self.continue_final_message):
            raise ValueError("the chat template's options go with messages, not a prompt")
        if self.messages is not None and self.add_special_tokens is not None:
            raise ValueError("add_special_tokens goes with a prompt (the chat template writes the special tokens)")
        return self


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = Field(None, description="must name the served model when given")
    tokens: List[PromptTokenId] = Field(description="ids within the vocabulary")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
