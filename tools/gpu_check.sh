#!/usr/bin/env bash
# stage4_fast on the GPU machine (H200), in one device call: install the carried wheels, make the test models,
# run the GPU test subset, run the offline benchmark. Everything it reports lands in $OUT.
#
# Here (this machine, repo root), once:
#     PYTHON=/work/venv/bin/python tools/gpu_check.sh download   # wheels into .whl/ (~20 MB), excluded from git
# Then the device call (carry: .whl and the SmolLM2 tokenizer files, which the random models reuse):
#     run(command="bash tools/gpu_check.sh all", timeout_s=600,
#         carry=[".whl", "models/SmolLM2-135M-Instruct/tokenizer.json",
#                "models/SmolLM2-135M-Instruct/tokenizer_config.json",
#                "models/SmolLM2-135M-Instruct/chat_template.jinja"])
# Modes: download | tests | bench | all (tests then bench) | tp (2 GPUs: python -m bench tp) | tp8b (2 GPUs: the 8B
# shape's TP 1 vs 2 throughput in what is left of CALL_BUDGET seconds, python -m bench tp; its teacher-forced TP check
# and the all-reduce timing, python -m bench tp-logits; TP8B_PARTS picks among "throughput logits allreduce",
# TP8B_SHAPES the throughput runs, name:sequences). A device command may run 600 s: "all" gives the tests
# TESTS_TIMEOUT (280 s) and the benchmark BENCH_TIMEOUT (280 s); run "tests" and "bench" as separate calls (within
# ~30 s the machine is still warm) to give each more. BENCH_ARGS overrides the benchmark's arguments.
# What fits one 600 s call (H200, measured 2026-11-30, JIT cache carried): HF alone on the full workload ~4 min
#   BENCH_ARGS="--stages hf --no-ablations --no-serve --rerun-busy 0"
# and stage4 + server + four ablation groups ~5 min
#   BENCH_ARGS="--stages stage4 --ablations overlap graph attn page --rerun-busy 0"
# JIT cache: FlashInfer (~75 s), the torch extension (~40 s) and Triton compile on a fresh machine. SAVE_JIT=1 packs
# them into $OUT/jit.tgz.* (15 MB parts); copy those into .gpu/ here (excluded from git) and carry ".gpu": the next
# call restores them (the installed wheels get old mtimes so ninja sees the carried builds as up to date).
# FlashAttention 4 needs a 92 MB wheel (over one call's carry limit): see ../shared/GPU_NOTES.md; without it the
# fa tests skip with that reason and "auto" picks FlashInfer (or Triton).
set -uo pipefail
MODE=${1:-all}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"

WHEELS=(  # versions as in the CPU venv; the GPU image has anyio, click, h11, msgpack, annotated-doc already
  flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2  # attention kernels (JIT-compiled there on first use)
  pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
)

if [[ $MODE == download ]]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  exec "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
fi

OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rules

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  find /tmp/site -type f -exec touch -d '2020-01-01' {} +  # JIT builds depend on these headers (see above)
fi
export FLASHINFER_WORKSPACE_BASE=/tmp/jit TORCH_EXTENSIONS_DIR=/tmp/jit/torch_ext TRITON_CACHE_DIR=/tmp/jit/triton
mkdir -p /tmp/jit
find stage4_fast/kernel/csrc -type f -exec touch -d '2020-01-01' {} +
if compgen -G ".gpu/jit.tgz.*" > /dev/null; then
  cat .gpu/jit.tgz.* | tar xzf - -C /tmp && echo "JIT cache restored from .gpu/jit.tgz.*"
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - <<'PY'
import importlib.metadata as md
for p in ("torch", "triton", "transformers", "flashinfer-python", "apache-tvm-ffi", "flash-attn-4"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "not installed")
PY
  nvcc --version | tail -1
} | tee "$OUT/env.txt"

make_models() {
  # the tiny models are seeded on the CPU, so they equal the ones the CPU tests use
  for m in tiny-qwen3 tiny-qwen3-moe; do python3 -m models make "$m" || return 1; done
  python3 -m models make qwen3-0.6b-shape --device cuda
}

run_tests() {
  make_models || { echo "model preparation failed"; return 1; }
  # PYTEST_K narrows the subset (pytest -k), e.g. PYTEST_K=triton after a change to the Triton kernels
  timeout "${TESTS_TIMEOUT:-280}" python3 -m pytest stage4_fast/tests/test_gpu.py -v -rs -s -p no:cacheprovider \
    ${PYTEST_K:+-k "$PYTEST_K"} --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.txt"
  return "${PIPESTATUS[0]}"
}

run_bench() {
  [[ -f models/qwen3-0.6b-shape/config.json ]] || python3 -m models make qwen3-0.6b-shape --device cuda
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-280}" python3 -m bench --gpu ${BENCH_ARGS:---stages hf stage4 --no-ablations} \
    --out "$OUT" 2>&1 | tee "$OUT/bench.txt"
  return "${PIPESTATUS[0]}"
}

status=0
case $MODE in
  tests) run_tests || status=$? ;;
  bench) run_bench || status=$? ;;
  all) run_tests || status=$?; run_bench || status=$? ;;
  tp) python3 -m models make tiny-qwen3 && python3 -m bench tp --out "$OUT" --deadline-s "${TP_DEADLINE:-300}" \
        || status=$? ;;  # nvidia-h200-x2: TP 1 vs 2 (NCCL), see bench/gpu_tp.py
  tp8b) python3 -m models make qwen3-8b-shape --device cuda || status=$?
    for part in ${TP8B_PARTS:-throughput logits allreduce}; do
      case $part in
        throughput) python3 -m bench tp --out "$OUT" --no-tiny --shapes ${TP8B_SHAPES:-qwen3-8b-shape:256} \
                      --deadline-s $(( ${CALL_BUDGET:-570} - SECONDS )) || status=$? ;;
        logits) python3 -m bench tp-logits --parts logits --out "$OUT" || status=$? ;;
        allreduce) timeout 150 python3 -m bench tp-logits --parts allreduce --out "$OUT" || status=$? ;;
      esac
    done ;;
  *) echo "usage: $0 download|tests|bench|all|tp|tp8b"; exit 2 ;;
esac
if [[ ${SAVE_JIT:-0} == 1 ]]; then
  (cd /tmp && tar czf - jit) | split -b 15m - "$OUT/jit.tgz." && echo "JIT cache saved to $OUT/jit.tgz.*"
fi
echo "gpu_check $MODE: exit $status"
exit "$status"
