"""The OpenAI-compatible request models, a module per request kind.

The models are strict (``"16"`` is not an int, ``1`` is not a bool) and their bounds are in the schema, so FastAPI's
OpenAPI document says exactly what is accepted; whatever fails validation becomes OpenAI's error body with a 4xx
status (``api_server``). A field that is not one of a model's fields is refused with a 400 that names it, never
ignored. Fields known but not implemented are listed in ``NOT_IMPLEMENTED_*`` with the values that ask for nothing
(``"n": 1``), which are accepted; implementing one = deleting its line there and adding a typed field.

- ``common``: the error, the strict base model, bounded integers, the prompt and stop shapes, usage
- ``sampling``: the fields /v1/completions and /v1/chat/completions share
- ``structured``: response_format and the other ways to ask for structured output
- ``chat``: /v1/chat/completions (``tools``: its functions and calls); ``completions``: /v1/completions and /generate
- ``tokenize``: /tokenize and /detokenize
"""
