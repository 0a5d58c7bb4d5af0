"""stage0_tiny — the whole LLM inference idea in one file under 200 lines (see ``tiny.py``)."""
