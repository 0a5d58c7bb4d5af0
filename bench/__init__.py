"""Benchmarks: `python -m bench` compares HF transformers and every stage, and measures each optimization.

Modules: `run` (the driver and its progress bar), `worker` (one engine/configuration per process), `adapters` (each
stage's public API behind one `generate`), `workloads` (the seeded requests), `report` (tables and plots).
"""
