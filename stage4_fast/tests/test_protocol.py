"""The request models are the one declaration of what the server implements: every other field is refused by name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from stage4_fast.server.protocol.chat import ChatCompletionRequest
from stage4_fast.server.protocol.completions import CompletionRequest, GenerateRequest
from stage4_fast.server.protocol.structured import STRUCTURED_OUTPUT_FIELDS

MODELS = {ChatCompletionRequest: {"messages": [{"role": "user", "content": "x"}]},
          CompletionRequest: {"prompt": "x"}, GenerateRequest: {"prompt": "x", "max_tokens": 1}}


@pytest.mark.parametrize("model", list(MODELS), ids=lambda m: m.__name__)
def test_not_implemented_fields_are_declared_once_and_in_the_schema(model):
    schema = model.model_json_schema()
    assert schema["additionalProperties"] is False
    for name, field in model.not_implemented.items():
        assert name not in model.model_fields  # implemented fields leave the list
        assert schema["properties"][name]["enum"] == [None, *field.neutral]


@pytest.mark.parametrize("model", list(MODELS), ids=lambda m: m.__name__)
def test_each_not_implemented_field_is_refused_by_name_unless_neutral(model):
    base = MODELS[model]
    for name, field in model.not_implemented.items():
        for value in (None, *field.neutral):
            model.model_validate({**base, name: value})
        with pytest.raises(ValidationError) as info:
            model.model_validate({**base, name: "something"})
        error = info.value.errors()[0]
        assert error["type"] == "not_implemented" and error["ctx"]["param"] == name


@pytest.mark.parametrize("model", list(MODELS), ids=lambda m: m.__name__)
def test_an_unknown_field_is_refused(model):
    with pytest.raises(ValidationError) as info:
        model.model_validate({**MODELS[model], "surely_not_a_field": 1})
    assert info.value.errors()[0]["type"] == "extra_forbidden"


def test_neutral_values_compare_as_json():
    field = CompletionRequest.not_implemented["best_of"]
    assert field.accepts(1) and field.accepts(1.0) and not field.accepts(True) and not field.accepts(2)


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fields, options", [
    ({}, None),  # the default: the generation prompt and nothing else
    ({"add_generation_prompt": True}, None),
    ({"continue_final_message": True}, {"add_generation_prompt": False, "continue_final_message": True}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": False}),
    ({"chat_template_kwargs": {"enable_thinking": False}},
     {"enable_thinking": False, "add_generation_prompt": True, "continue_final_message": False}),
])
def test_chat_template_options(fields, options):
    assert ChatCompletionRequest.model_validate({"messages": CHAT, **fields}).chat_options() == options


@pytest.mark.parametrize("fields, says", [
    ({"add_generation_prompt": True, "continue_final_message": True}, "cannot both be true"),
    ({"chat_template_kwargs": {"tokenize": True}}, "cannot set 'tokenize'"),
    ({"chat_template_kwargs": {"messages": []}}, "cannot set 'messages'"),
])
def test_chat_template_options_that_cannot_hold_are_refused(fields, says):
    with pytest.raises(ValidationError, match=says):
        ChatCompletionRequest.model_validate({"messages": CHAT, **fields})


def test_the_reserved_template_names_cover_the_template_calls_parameters():
    import inspect

    from transformers import PreTrainedTokenizerBase

    from stage4_fast.server.protocol.chat import CHAT_TEMPLATE_RESERVED

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert named <= CHAT_TEMPLATE_RESERVED, named - CHAT_TEMPLATE_RESERVED
    schema = ChatCompletionRequest.model_json_schema()["properties"]["chat_template_kwargs"]["anyOf"][0]
    assert set(schema["propertyNames"]["not"]["enum"]) == CHAT_TEMPLATE_RESERVED  # the document says so too


def test_template_variables_carry_only_what_the_wire_carries():
    kwargs = {"a": [1, 2.5, "x", None, True], "b": {"c": 2**60}, "d": False}  # beyond 2^53: read as a number
    got = ChatCompletionRequest.model_validate({"messages": CHAT, "chat_template_kwargs": kwargs}).chat_template_kwargs
    assert got == {"a": [1, 2.5, "x", None, True], "b": {"c": float(2**60)}, "d": False}
    assert type(got["b"]["c"]) is float and got["d"] is False
    with pytest.raises(ValidationError):  # deeper than a list or object of scalars
        ChatCompletionRequest.model_validate({"messages": CHAT, "chat_template_kwargs": {"a": [[1]]}})


@pytest.mark.parametrize("model, base", [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest,
                                                                               {"messages": CHAT})])
def test_min_tokens_goes_with_stop_tokens_and_strings(model, base):
    assert model.model_validate({**base, "min_tokens": 3, "stop_token_ids": [5]}).min_tokens == 3
    assert model.model_validate({**base, "min_tokens": 3, "stop": "."}).stop_list() == ["."]
    with pytest.raises(ValidationError):
        model.model_validate({**base, "min_tokens": -1})


@pytest.mark.parametrize("fields, grammar", [
    ({}, {}),
    ({"response_format": {"type": "text"}}, {}),
    ({"response_format": {"type": "json_object"}}, {"json_schema": '{"type": "object"}'}),
    ({"json_schema": '{"type": "array"}'}, {"json_schema": '{"type": "array"}'}),  # SGLang's three
    ({"regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"ebnf": 'root ::= "a"'}, {"ebnf": 'root ::= "a"'}),
    ({"structured_outputs": {"json": {"type": "array"}}}, {"json_schema": '{"type": "array"}'}),  # vLLM's
    ({"structured_outputs": {"json": '{"type": "array"}'}}, {"json_schema": '{"type": "array"}'}),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"ebnf": 'root ::= "a"'}),
    ({"structured_outputs": {"json_object": True}}, {"json_schema": '{"type": "object"}'}),
    # vLLM's disable_any_whitespace: false lets JSON hold free whitespace; true is this server's default; it is
    # about JSON only
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
     {"json_schema": '{"type": "object"}', "json_any_whitespace": True}),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}},
     {"json_schema": '{"type": "object"}'}),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": False}}, {"regex": "a"}),
    ({"structured_outputs": {"choice": ["yes", 'a "b"\\c\n']}}, {"ebnf": 'root ::= "yes" | "a \\"b\\"\\\\c\\n"'}),
    ({"structured_outputs": {"structural_tag": '{"structures": [], "triggers": []}'}},
     {"structural_tag": '{"structures": [], "triggers": []}'}),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]}},
     {"structural_tag": '{"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], '
                        '"triggers": ["<f"]}'}),
])
def test_each_way_to_ask_for_structured_output_becomes_one_grammar(fields, grammar):
    assert CompletionRequest.model_validate({"prompt": "x", **fields}).grammar() == grammar


@pytest.mark.parametrize("model, base", [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest,
                                                                               {"messages": CHAT})])
def test_one_structured_output_per_request(model, base):
    one = {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}, "json_schema": "{}",
           "regex": "a", "ebnf": 'root ::= "a"'}
    assert tuple(one) == STRUCTURED_OUTPUT_FIELDS
    for name, value in one.items():
        model.model_validate({**base, name: value, **{other: None for other in one if other != name}})
        if name != "response_format":
            model.model_validate({**base, name: value, "response_format": {"type": "text"}})  # text: no constraint
        for other, second in one.items():
            if other != name:
                with pytest.raises(ValidationError, match="only one way to ask for structured output"):
                    model.model_validate({**base, name: value, other: second})
        assert "at most one of response_format (json), structured_outputs" in (
            model.model_json_schema()["properties"][name]["description"])


@pytest.mark.parametrize("outputs, valid", [
    ({"json": {"type": "object"}}, True), ({"regex": "a"}, True), ({"choice": ["a"]}, True),
    ({"grammar": 'root ::= "a"'}, True), ({"json_object": True}, True), ({"regex": "a", "json_object": False}, True),
    ({"regex": "a", "choice": None}, True),
    ({}, False), ({"json_object": False}, False), ({"regex": "a", "grammar": "b"}, False),
    ({"regex": "a", "json_object": True}, False), ({"choice": []}, False),
    ({"structural_tag": "{}"}, True), ({"structural_tag": "{}", "regex": "a"}, False),
])
def test_structured_outputs_takes_exactly_one_constraint_and_the_schema_says_so(outputs, valid):
    jsonschema = pytest.importorskip("jsonschema")
    body = {"prompt": "x", "structured_outputs": outputs}
    schema = CompletionRequest.model_json_schema()
    if valid:
        CompletionRequest.model_validate(body)
        jsonschema.validate(body, schema)
    else:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(body)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(body, schema)
