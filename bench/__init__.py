"""Benchmarks: `python -m bench` compares HF transformers and every stage, and measures each optimization.

Modules: `__main__` (the one entry point: `python -m bench [COMMAND]`), `run` (the driver and its progress bar),
`worker` (one engine/configuration per process), `serve` (one server, closed and open loop), `adapters` (each
stage's public API behind one `generate`), `workloads` (the seeded requests), `report` (tables and plots), `meta`
(what every results file records), `gpu_*` (GPU-only: time breakdown, decode-kernel sweep, TP on two GPUs).
"""
