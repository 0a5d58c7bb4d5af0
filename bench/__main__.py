"""`python -m bench [COMMAND] [ARGS]`: the one entry point of the benchmarks (`python -m bench COMMAND --help`).

commands:
  run            (the default) HF transformers and every stage on the same workloads, plus the ablations
  serve          one server: time to first token and tokens/s at 1 and 16 clients, a request-rate sweep (--rates)
  serve-path     the serving path alone (engine forward stubbed): CPU µs per streamed token in each process
  worker         one engine, one configuration, one process: what `run` starts for every measurement
  breakdown      where one offline `generate` spends its time: per step host vs device, a kernel profile (GPU)
  kv-accuracy    what a bf16 / fp8 KV cache costs in accuracy against a full-precision one (stage4)
  tp             TP 1 vs TP 2: fp32 equality with HF, bf16 agreement and throughput (2 GPUs)
  tp-logits      TP 1 vs TP 2 teacher-forced logits against HF, and the all-reduce's cost (2 GPUs)
  lm-eval        lm-eval through the stage4 server vs lm-eval's HF backend on a task of the repo (needs lm-eval)
  moe-tune       the fused MoE kernel's block configs per token count for this GPU (stage4_fast/kernel/moe_configs)

Results go to bench/local/ (gitignored) unless `--out` says otherwise; `--out bench/results` replaces the committed
results of this machine. bench/README.md describes the workloads and every column.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"run": "run", "serve": "serve", "serve-path": "serve_path", "worker": "worker",
            "breakdown": "gpu_breakdown", "kv-accuracy": "kv_accuracy", "tp": "gpu_tp", "tp-logits": "gpu_tp_logits",
            "lm-eval": "lm_eval_parity", "moe-tune": "moe_tune"}


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv and not argv[0].startswith("-"):
        if argv[0] not in COMMANDS:
            print(f"python -m bench: unknown command {argv[0]!r}; one of {', '.join(COMMANDS)} (or only flags: run)",
                  file=sys.stderr)
            return 2
        name, argv = argv[0], argv[1:]
    else:
        name = "run"
    # imported on demand: the GPU commands import triton, which a CPU machine may lack
    return importlib.import_module(f"bench.{COMMANDS[name]}").main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
