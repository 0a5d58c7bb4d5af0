#!/usr/bin/env bash
# The GPU tests and the GPU benchmark on a machine WITHOUT network access: what `nox -s gpu` does, with wheels
# downloaded beforehand instead of pip's index, and without nox. The GPU machine needs CUDA and a python3 with torch,
# transformers, pytest and matplotlib; the rest of what stage4 needs there comes from .whl/.
#
# Where there is network, in the repository root, once (wheels for CPython 3.12, manylinux x86_64; ~20 MB):
#     tools/gpu_check.sh download             # -> .whl/ (gitignored); PYTHON=... picks the pip that downloads
# Then copy the repository with .whl/ and the SmolLM2 tokenizer files (models/SmolLM2-135M-Instruct/tokenizer.json,
# tokenizer_config.json, chat_template.jinja: the random models reuse them) to the GPU machine, and there:
#     tools/gpu_check.sh all                  # the GPU tests, then `python -m bench --gpu`
#
# Modes: download | tests | bench | all (tests, then bench) | tp (2 GPUs: `python -m bench tp`, no new step after
# TP_DEADLINE seconds, default 300) | tp8b (2 GPUs, the Qwen3-8B shape: TP 1 vs 2 throughput, teacher-forced logits,
# all-reduce timing; TP8B_PARTS picks among "throughput logits allreduce", TP8B_SHAPES the throughput runs as
# name:sequences, TP8B_SECONDS bounds them, default 570) | kv (the fp8 KV cache: KV_PARTS picks among "tests
# accuracy throughput": its GPU tests, `bench kv-accuracy` against a bf16 KV cache through KV_BACKENDS
# (default triton), and the offline workload + server burst with kv_cache_dtype auto
# and fp8_e4m3 into kv_throughput.jsonl; KV_SECONDS stops each part after that many seconds) | served (the
# 256-request streaming burst against offline `LLM.generate` on the burst model, qwen3-0.6b-shape-v49k: per round the
# offline run, then one burst per server variant, in turn, into served.jsonl; SERVED_OPTIONS = the engine options of
# every run, default '{"kv_cache_dtype": "fp8_e4m3"}'; SERVED_VARIANTS = the server options each burst adds, as
# space-separated JSON objects, default '{} {"api_server_count":2} {"stream_interval":4}'; SERVED_ROUNDS, default 2;
# SERVED_SECONDS stops each run after that many seconds) | moe-tune (`python -m bench moe-tune` at Qwen3-30B-A3B's
# MoE shape, ~4 min: the JSON into RESULTS_DIR/moe_configs/ and stage4_fast/kernel/moe_configs/).
# Environment: RESULTS_DIR = results folder (default /tmp/gpu_check): env.txt (date, GPU, driver, versions, commit),
# gpu_tests.txt/.xml, bench.txt and the benchmark's results files, tp*.jsonl. PYTEST_K narrows the tests (pytest -k),
# e.g. PYTEST_K=triton after a change to the Triton kernels. BENCH_ARGS replaces the benchmark's arguments (default:
# the full `--gpu` run), e.g. "--stages stage4 --no-ablations --no-serve". TESTS_TIMEOUT / BENCH_TIMEOUT stop a part
# after that many seconds. Runs that have to fit a time limit (measured on an H200, compile caches warm): HF alone on
# the full workload ~4 min ("--stages hf --no-ablations --no-serve --rerun-busy 0"); stage4 with the server and the
# overlap, graph, attn and page ablations ~5 min ("--stages stage4 --ablations overlap graph attn page --rerun-busy 0").
# Compile caches: a fresh machine spends ~2 min compiling FlashInfer (~75 s), the torch extension (~40 s) and the
# Triton kernels. SAVE_JIT=1 packs those caches into jit.tgz.* (15 MB parts) in the results folder; put the parts in
# .gpu/ (gitignored) of the copy that runs next and they are restored before the tests.
# FlashAttention 4 (flash-attn-4, a pre-release 92 MB wheel) is not among the downloaded wheels: without it the fa
# tests skip with that reason and "auto" attention picks Triton (stage4_fast/README.md).
set -uo pipefail
MODE=${1:-all}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"

WHEELS=(  # what stage4 needs beyond torch/transformers, at the versions the CPU tests use
  flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2  # attention kernels (JIT-compiled on first use)
  pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
  setproctitle==1.3.8  # the server names its processes (without it the server does not start)
  uvloop==0.23.0 httptools==0.9.0 orjson==3.13.0  # uvicorn's event loop and HTTP parser, the chunks' JSON
  xgrammar==0.2.9  # response_format
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1 idna==3.20  # the benchmark's streaming client (bench/stream_client.py)
)

if [[ $MODE == download ]]; then
  exec "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
fi

results_dir=${RESULTS_DIR:-/tmp/gpu_check}
mkdir -p "$results_dir"
exec > >(tee -a "$results_dir/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# NVLink multicast (NVLS) off, as in the recorded GPU results: on shared or virtualised multi-GPU hosts it can take
# the GPUs out of service, and the all-reduces of 2 GPUs do not need it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if compgen -G ".whl/*.whl" > /dev/null; then
  # --target: the machine's Python may be a system one that pip must not modify
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  find /tmp/site -type f -exec touch -d '2020-01-01' {} +  # restored JIT builds depend on these headers (see above)
fi
export FLASHINFER_WORKSPACE_BASE=/tmp/jit TORCH_EXTENSIONS_DIR=/tmp/jit/torch_ext TRITON_CACHE_DIR=/tmp/jit/triton
mkdir -p /tmp/jit
find stage4_fast/kernel/csrc -type f -exec touch -d '2020-01-01' {} +  # so that ninja sees restored builds as current
if compgen -G ".gpu/jit.tgz.*" > /dev/null; then
  cat .gpu/jit.tgz.* | tar xzf - -C /tmp && echo "JIT cache restored from .gpu/jit.tgz.*"
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no .git in this copy)')"
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
} | tee "$results_dir/env.txt"

make_models() {
  # the tiny models are seeded on the CPU, so they equal the ones the CPU tests use (as in noxfile.py's GPU_MODELS)
  for m in tiny-qwen3 tiny-qwen3-moe tiny-qwen3-moe-dense; do python3 -m models make "$m" || return 1; done
  [[ -f models/qwen3-0.6b-shape/config.json ]] || python3 -m models make qwen3-0.6b-shape --device cuda
  [[ -f models/qwen3-30b-a3b-shape-2l/config.json ]] \
    || python3 -m models make qwen3-30b-a3b-shape --layers 2 --device cuda
}

maybe_timeout() {  # maybe_timeout SECONDS CMD...: CMD, stopped after SECONDS when that is set
  if [[ -n $1 ]]; then timeout "$1" "${@:2}"; else "${@:2}"; fi
}

run_tests() {
  make_models || { echo "model preparation failed"; return 1; }
  # the GPU subset, as noxfile.py's GPU_TESTS
  maybe_timeout "${TESTS_TIMEOUT:-}" python3 -m pytest stage4_fast/tests/test_gpu.py \
    stage4_fast/tests/test_fused_kernels.py -v -rs -s -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} \
    --junitxml="$results_dir/gpu_tests.xml" 2>&1 | tee "$results_dir/gpu_tests.txt"
  return "${PIPESTATUS[0]}"
}

run_bench() {
  [[ -f models/qwen3-0.6b-shape/config.json ]] || python3 -m models make qwen3-0.6b-shape --device cuda
  # shellcheck disable=SC2086
  maybe_timeout "${BENCH_TIMEOUT:-}" python3 -m bench --gpu ${BENCH_ARGS:-} --out "$results_dir" 2>&1 | tee "$results_dir/bench.txt"
  return "${PIPESTATUS[0]}"
}

status=0
case $MODE in
  tests) run_tests || status=$? ;;
  bench) run_bench || status=$? ;;
  all) run_tests || status=$?; run_bench || status=$? ;;
  tp) python3 -m models make tiny-qwen3 && python3 -m bench tp --out "$results_dir" --deadline-s "${TP_DEADLINE:-300}" \
        || status=$? ;;
  tp8b) python3 -m models make qwen3-8b-shape --device cuda || status=$?
    for part in ${TP8B_PARTS:-throughput logits allreduce}; do
      case $part in
        throughput) python3 -m bench tp --out "$results_dir" --no-tiny --shapes ${TP8B_SHAPES:-qwen3-8b-shape:256} \
                      --deadline-s $(( ${TP8B_SECONDS:-570} - SECONDS )) || status=$? ;;
        logits) python3 -m bench tp-logits --parts logits --out "$results_dir" || status=$? ;;
        allreduce) timeout 150 python3 -m bench tp-logits --parts allreduce --out "$results_dir" || status=$? ;;
      esac
    done ;;
  kv) make_models || status=$?
    for part in ${KV_PARTS:-tests accuracy throughput}; do
      case $part in
        tests) PYTEST_K=${PYTEST_K:-fp8} TESTS_TIMEOUT=${KV_SECONDS:-} run_tests || status=$? ;;
        accuracy) maybe_timeout "${KV_SECONDS:-}" python3 -m bench kv-accuracy --gpu --out "$results_dir" \
                    --backends ${KV_BACKENDS:-triton} || status=$? ;;
        throughput) for kv in auto fp8_e4m3; do
            # offline and the served burst in separate processes: a server started beside a live engine finds
            # only the GPU memory that engine left free
            for task in offline serve_offline; do
              maybe_timeout "${KV_SECONDS:-}" python3 -m bench worker --stage stage4_fast --gpu --json --task "$task" \
                --model models/qwen3-0.6b-shape --options "{\"kv_cache_dtype\": \"$kv\"}" \
                >> "$results_dir/kv_throughput.jsonl" || status=$?
            done
          done ;;
      esac
    done ;;
  served) burst_model=models/qwen3-0.6b-shape-v49k
    [[ -f $burst_model/config.json ]] || python3 -m models make qwen3-0.6b-shape-v49k --device cuda || status=$?
    base=${SERVED_OPTIONS:-'{"kv_cache_dtype": "fp8_e4m3"}'}
    for round in $(seq "${SERVED_ROUNDS:-2}"); do
      # each run in its own process (a server started beside a live engine finds only what that engine left free)
      for variant in offline ${SERVED_VARIANTS:-'{}' '{"api_server_count":2}' '{"stream_interval":4}'}; do
        task=serve_offline options=$(python3 -c 'import json, sys; print(json.dumps({**json.loads(sys.argv[1]),
          **json.loads(sys.argv[2])}))' "$base" "${variant/offline/\{\}}")
        [[ $variant == offline ]] && task=offline
        echo "round $round: $task $options"
        maybe_timeout "${SERVED_SECONDS:-}" python3 -m bench worker --stage stage4_fast --gpu --json --task "$task" \
          --model "$burst_model" --options "$options" >> "$results_dir/served.jsonl" || status=$?
      done
    done ;;
  moe-tune) # the fused MoE kernel's configs for Qwen3-30B-A3B's shape on this GPU, into the results folder and
    # stage4_fast/kernel/moe_configs/ (so that tests and benchmarks run later on this copy take them)
    python3 -m bench moe-tune --experts 128 --n 768 --hidden 2048 --top-k 8 --out "$results_dir/moe_configs" \
      && mkdir -p stage4_fast/kernel/moe_configs && cp "$results_dir"/moe_configs/*.json stage4_fast/kernel/moe_configs/ \
      && tar czf "$results_dir/moe_configs.tgz" -C "$results_dir" moe_configs || status=$? ;;  # a plain name to copy
  *) echo "usage: $0 download|tests|bench|all|tp|tp8b|kv|served|moe-tune"; exit 2 ;;
esac
if [[ ${SAVE_JIT:-0} == 1 ]]; then
  (cd /tmp && tar czf - jit) | split -b 15m - "$results_dir/jit.tgz." && echo "JIT cache saved to $results_dir/jit.tgz.*"
fi
echo "gpu_check $MODE: exit $status"
exit "$status"
