"""stage0_tiny — the whole LLM inference idea in one ~140-line file (see ``tiny.py``)."""
