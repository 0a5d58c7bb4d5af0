"""Test sessions. They run in the current environment (``venv_backend="none"``): the README's install line sets it
up once, so no session spends minutes reinstalling torch.

    nox -s smoke         # about a minute: every stage against HF on one prompt, one request through stage4's server
    nox -s stage2        # stage2's own tests + the shared HF-alignment suite for stage2
    nox -s tests         # every stage, one pytest run (models prepared once)
    nox -s lint          # ruff, stage isolation, no drift between the stages' copies, hygiene, size budgets
    nox -s reliability   # the servers' reliability/security tests (fuzzing, storm, load, auth, shutdown)
    nox -s animations    # six GIFs of real CPU runs into bench/local/animations (tools/animate.py)
    nox -s gpu           # on a machine with an NVIDIA GPU: install the GPU extras, GPU tests, GPU benchmark
"""

from __future__ import annotations

import argparse
import glob
import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "tests"]

STAGES = ["stage0_tiny", "stage1_correct", "stage2_scheduled", "stage3_served", "stage4_fast"]
# the GPU subset (each skips without CUDA) and the models it uses; tools/gpu_check.sh runs the same without nox
GPU_TESTS = ["stage4_fast/tests/test_gpu.py", "stage4_fast/tests/test_fused_kernels.py"]
GPU_MODELS = [["tiny-qwen3"], ["tiny-qwen3-moe"], ["tiny-qwen3-moe-dense"], ["qwen3-0.6b-shape", "--device", "cuda"],
              ["qwen3-30b-a3b-shape", "--layers", "2", "--device", "cuda"]]  # (made once: the make returns at once)
# NVLink multicast (NVLS) off, as in the recorded GPU results: on shared or virtualised multi-GPU hosts it can take
# the GPUs out of service, and the all-reduces of 2 GPUs do not need it
NO_NVLS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _stage_args(stage: str) -> list[str]:
    tests = Path(stage) / "tests"
    return ([str(tests)] if tests.is_dir() else []) + ["shared_tests", "--stage", stage]


def _make_stage_session(index: int, stage: str) -> None:
    @nox.session(name=f"stage{index}")
    def _session(session: nox.Session) -> None:
        session.run("python", "-m", "pytest", *_stage_args(stage), *session.posargs)

    _session.__doc__ = f"{stage}: its own tests + the shared suite"


for _i, _stage in enumerate(STAGES):
    _make_stage_session(_i, _stage)


@nox.session
def tests(session: nox.Session) -> None:
    """All stages' tests and the shared suite for every stage, in one pytest run."""
    paths = [str(Path(s) / "tests") for s in STAGES if (Path(s) / "tests").is_dir()]
    session.run("python", "-m", "pytest", *paths, "shared_tests", "tools/tests", *session.posargs)


@nox.session
def smoke(session: nox.Session) -> None:
    """A quick check of an install: each stage's HF alignment on one prompt, and stage4's server end to end."""
    session.run("python", "-m", "pytest", "shared_tests", "-q", "-k",
                "test_single_prompt_matches_hf and tiny-qwen3-short or test_server_end_to_end and stage4_fast",
                *session.posargs)


@nox.session
def reliability(session: nox.Session) -> None:
    """Every served stage's tests/reliability (also part of ``tests``, which collects each tests dir recursively)."""
    paths = [str(p) for s in STAGES if (p := Path(s) / "tests" / "reliability").is_dir()]
    session.run("python", "-m", "pytest", *paths, "-q", *session.posargs)


@nox.session
def animations(session: nox.Session) -> None:
    """The six GIFs of real CPU runs into bench/local/animations (``-- --model tiny-qwen3`` for a quick one)."""
    session.run("python", "tools/animate.py", "all", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, stage isolation, drift (every change in exactly one topic), hygiene, the size budgets."""
    session.run("ruff", "check", ".")
    session.run("python", "tools/stages.py", "check")
    session.run("python", "tools/stages.py", "drift")
    session.run("python", "tools/hygiene.py")
    session.run("python", "tools/budgets.py")


def _gpu_args(posargs: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="nox -s gpu --", description="options of the GPU session; any other option "
                                 "goes to `python -m bench --gpu` (e.g. --stages hf stage4 --no-ablations)")
    ap.add_argument("--offline-wheels", metavar="DIR", default=None,
                    help="a machine without network: install the wheels in DIR (pip --no-index --no-deps, into "
                         ".gpu/site) instead of resolving .[gpu,test,bench]; `tools/gpu_check.sh download` fetches "
                         "them where there is network")
    ap.add_argument("--no-install", action="store_true", help="use the environment as it is")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--tests-only", action="store_true")
    only.add_argument("--bench-only", action="store_true")
    ap.add_argument("-k", dest="pytest_k", default=None, help="pytest -k expression for the GPU tests")
    ap.add_argument("--out", default="bench/local",
                    help="where the benchmark's results and the test report go (default bench/local, gitignored)")
    return ap.parse_known_args(posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU path: install .[gpu,test,bench], make the models, run the GPU tests, then `python -m bench --gpu`.

    Needs an NVIDIA GPU that torch sees. Options after `--` (`nox -s gpu -- --help`): --offline-wheels DIR for a
    machine without network, --tests-only / --bench-only, -k EXPR, --out DIR; any other goes to the benchmark.
    """
    args, bench_args = _gpu_args(session.posargs)
    session.env.update(NO_NVLS)
    if args.offline_wheels:
        wheels = sorted(glob.glob(str(Path(args.offline_wheels) / "*.whl")))
        if not wheels:
            session.error(f"--offline-wheels: no .whl files in {args.offline_wheels}")
        site = Path(".gpu/site").resolve()  # --target: works in a venv and beside a system Python alike
        session.run("python", "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade", "--target", str(site),
                    *wheels)
        session.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    elif not args.no_install:
        session.run("python", "-m", "pip", "install", "-e", ".[gpu,test,bench]")
    session.run("python", "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else "
                "'nox -s gpu: torch sees no CUDA GPU (a CPU-only torch, or no driver)')")
    for model in GPU_MODELS:
        if not (Path("models") / model[0] / "config.json").exists():
            session.run("python", "-m", "models", "make", *model)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.bench_only:
        k = ["-k", args.pytest_k] if args.pytest_k else []
        session.run("python", "-m", "pytest", *GPU_TESTS, "-v", "-rs", *k,
                    f"--junitxml={Path(args.out) / 'gpu_tests.xml'}")
    if not args.tests_only:
        session.run("python", "-m", "bench", "--gpu", "--out", args.out, *bench_args)
