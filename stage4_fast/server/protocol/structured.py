"""Structured output: response_format and vLLM's structured_outputs, each becoming one xgrammar grammar."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Mapping, Tuple

from pydantic import ConfigDict, Field, model_validator

from ...sampling.grammar import JSON_OBJECT_SCHEMA
from .common import NI, NotImplementedField, Strict, add_not_implemented


class JSONSchemaFormat(Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: Dict[str, Any] = Field(alias="schema", description="the JSON schema the output must match")
    strict: bool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


class TaggedStructure(Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    begin: str = Field(min_length=1, description="the text that opens the structure (starts with a trigger)")
    schema_: Dict[str, Any] = Field(alias="schema", description="the JSON schema of what comes between")
    end: str = Field(description="the text that closes it")


class StructuralTagResponseFormat(Strict):
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
    add_not_implemented(schema, cls)
    # the schema states the rule _check_one enforces
    null, names = {"type": "null"}, ["json", "regex", "choice", "grammar", "structural_tag"]
    schema["anyOf"] = [
        *({"required": [name], "properties": {**{other: null for other in names if other != name},
                                              name: {"not": null}, "json_object": {"anyOf": [null, {"const": False}]}}}
          for name in names),
        {"required": ["json_object"], "properties": {**{name: null for name in names}, "json_object": {"const": True}}},
    ]


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True,
                              json_schema_extra=_structured_outputs_rules)

    not_implemented: ClassVar[Mapping[str, NotImplementedField]] = {
        "whitespace_pattern": NI((), "a pattern for JSON's whitespace"),
    }
    json_: Dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or JSON text)")
    regex: str | None = Field(None, description="a regular expression")
    choice: List[str] | None = Field(None, min_length=1, description="the output is one of these strings")
    grammar: str | None = Field(None, description="an EBNF grammar (xgrammar's dialect, rule root)")
    json_object: bool | None = Field(None, description="true: any JSON object")
    structural_tag: str | None = Field(None, description="a structural tag, as JSON text")
    # false: JSON output may hold free whitespace between its tokens (vLLM's default); true or null: none (ours)
    disable_any_whitespace: bool | None = Field(None, description="false: JSON output may hold free whitespace")

    @model_validator(mode="after")
    def _check_one(self) -> StructuredOutputs:
        if len(self.constraints()) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, structural_tag, json_object: true")
        return self

    def constraints(self) -> List[str]:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "structural_tag": self.structural_tag}
        return [name for name, value in given.items() if value is not None] + ["json_object"] * bool(self.json_object)

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
ONE_OF_THEM = "; at most one of response_format (json), structured_outputs, json_schema, regex, ebnf"


class StructuredOutputFields(Strict):
    response_format: ResponseFormat | None = Field(None, description="json_object, json_schema or structural_tag"
                                                                     + ONE_OF_THEM)
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension" + ONE_OF_THEM)
    json_schema: str | None = Field(None, description="SGLang extension: a JSON schema, as JSON text" + ONE_OF_THEM)
    regex: str | None = Field(None, description="SGLang extension: a regular expression" + ONE_OF_THEM)
    ebnf: str | None = Field(None, description="SGLang extension: an EBNF grammar (rule root)" + ONE_OF_THEM)

    def grammar(self) -> Dict[str, Any]:
        """The structured output as ``SamplingParams``' fields (kind -> source); empty for free text."""
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

    @model_validator(mode="after")
    def _check_one_grammar(self) -> StructuredOutputFields:
        asked = [name for name in STRUCTURED_OUTPUT_FIELDS if getattr(self, name) is not None]
        if isinstance(self.response_format, TextFormat):
            asked.remove("response_format")  # free text: no constraint
        if len(asked) > 1:
            raise ValueError(f"only one way to ask for structured output per request: {', '.join(asked)} given")
        return self
