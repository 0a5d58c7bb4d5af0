"""The OpenAI-compatible request models, a module per request kind.

The models are strict (``"16"`` is not an int) with their bounds in the schema; an unknown field is a 400 that names
it, never ignored. Fields known but not implemented are in ``NOT_IMPLEMENTED_*`` with the values that ask for
nothing (``"n": 1``), which are accepted."""
