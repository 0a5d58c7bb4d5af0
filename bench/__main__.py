"""`python -m bench [COMMAND] [ARGS]`: the one entry point of the benchmarks (`python -m bench COMMAND --help`).

commands:
  run            (the default) HF transformers and every stage on the same workloads, plus the ablations
  serve          one server: time to first token and tokens/s at 1 and 16 clients, a request-rate sweep (--rates)
  serve-path     the serving path alone (engine forward stubbed): CPU µs per streamed token in each process
  worker         one engine, one configuration, one process: what `run` starts for every measurement
  ab             this checkout against another commit, in alternating rounds of one worker task
  breakdown      where one offline `generate` spends its time: per step host vs device, a kernel profile (GPU)
  decode-sweep   the Triton decode kernel's launch parameters at the real workload's shapes (GPU)
  decode-shapes  a decode-attention launch's cost as its batch's sequences grow and spread (GPU)
  gemv-sweep     the one-token Triton GEMV against cuBLAS at the model's linear shapes (GPU)
  gemm-sweep     decode-batch GEMMs: cuBLAS, cuBLASLt and a split-K Triton GEMM at the model's shapes (GPU)
  cublaslt-sweep every cuBLASLt heuristic algorithm for the decode-batch GEMMs against F.linear's pick (GPU)
  layer-chain    a decode layer's kernels in a graph: what L2 weight prefetch and dependent launch save (GPU)
  gemm-waits     which cuBLAS GEMM kernels wait for the kernel before them (could edges into them be early?) (GPU)
  launch-cost    what launching a prefill layer's kernels costs the host, per kernel (GPU)
  microbatch     a decode step as two half batches on two streams: GEMMs beside the other half's attention (GPU)
  prefill-sweep  the Triton prefill attention kernel's launch parameters at the workload's prefill steps (GPU)
  kv-accuracy    what a bf16 / fp8 KV cache costs in accuracy against a full-precision one (stage4)
  tp             TP 1 vs TP 2: fp32 equality with HF, bf16 agreement and throughput (2 GPUs)
  tp-logits      TP 1 vs TP 2 teacher-forced logits against HF, and the all-reduce's cost (2 GPUs)
  api-costs      what logprobs, echo, penalties, logit bias, min-p and a JSON grammar cost a stage4 batch
  api-host       what a JSON grammar and the penalties cost the host per step (stage4, no model)
  lm-eval        lm-eval through the stage4 server vs lm-eval's HF backend on a task of the repo (needs lm-eval)

Results go to bench/local/ (gitignored) unless `--out` says otherwise; `--out bench/results` replaces the committed
results of this machine. bench/README.md describes the workloads and every column.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"run": "run", "serve": "serve", "serve-path": "serve_path", "worker": "worker", "ab": "ab",
            "breakdown": "gpu_breakdown", "decode-sweep": "gpu_decode_sweep", "decode-shapes": "gpu_decode_shapes",
            "gemv-sweep": "gpu_gemv_sweep", "gemm-sweep": "gpu_gemm_sweep",
            "cublaslt-sweep": "gpu_cublaslt_sweep", "layer-chain": "gpu_layer_chain",
            "gemm-waits": "gpu_gemm_waits",
            "launch-cost": "gpu_launch_cost", "microbatch": "gpu_microbatch",
            "prefill-sweep": "gpu_prefill_sweep",
            "kv-accuracy": "kv_accuracy",
            "tp": "gpu_tp", "tp-logits": "gpu_tp_logits", "api-costs": "api_costs", "api-host": "api_host",
            "lm-eval": "lm_eval_parity"}


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
