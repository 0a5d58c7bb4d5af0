"""The request models are the one declaration of what the server implements: every other field is refused by name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from stage3_served.server.protocol.chat import ChatCompletionRequest
from stage3_served.server.protocol.completions import CompletionRequest, GenerateRequest

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
    field = CompletionRequest.not_implemented["n"]
    assert field.accepts(1) and field.accepts(1.0) and not field.accepts(True) and not field.accepts(2)
