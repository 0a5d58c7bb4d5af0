"""`nox -s gpu`, the documented GPU path, on a CPU: which commands it runs, in which order, with which options
(the commands themselves need a GPU; their CPU-testable parts are tested where they live)."""

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("noxfile_under_test", REPO / "noxfile.py")
noxfile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(noxfile)


class FakeSession:
    def __init__(self, *posargs: str) -> None:
        self.posargs, self.env, self.commands = list(posargs), {}, []

    def run(self, *args: str, **kwargs) -> None:
        self.commands.append(list(args))

    def error(self, message: str) -> None:
        raise RuntimeError(message)


def run_session(tmp_path, monkeypatch, *posargs: str) -> FakeSession:
    monkeypatch.chdir(tmp_path)  # no models there: every GPU model gets made
    session = FakeSession(*posargs)
    noxfile.gpu.func(session)  # the function under the nox.session decorator
    return session


def test_installs_the_extras_then_models_tests_and_benchmark(tmp_path, monkeypatch):
    s = run_session(tmp_path, monkeypatch)
    assert s.commands[0] == ["python", "-m", "pip", "install", "-e", ".[gpu,test,bench]"]
    assert "torch.cuda.is_available()" in s.commands[1][-1]
    n = len(noxfile.GPU_MODELS)
    assert s.commands[2:2 + n] == [["python", "-m", "models", "make", *m] for m in noxfile.GPU_MODELS]
    tests = s.commands[2 + n]
    assert tests[:3] == ["python", "-m", "pytest"] and set(noxfile.GPU_TESTS) <= set(tests)
    assert s.commands[3 + n] == ["python", "-m", "bench", "--gpu", "--out", "bench/local"]
    assert s.env["NCCL_NVLS_ENABLE"] == "0"


def test_other_options_go_to_the_benchmark(tmp_path, monkeypatch):
    s = run_session(tmp_path, monkeypatch, "--bench-only", "--no-install", "--out", "bench/results", "--stages", "hf",
                    "stage4", "--no-ablations")
    assert not any(c[:3] == ["python", "-m", "pytest"] for c in s.commands)
    assert not any("pip" in c for c in s.commands)
    assert s.commands[-1] == ["python", "-m", "bench", "--gpu", "--out", "bench/results", "--stages", "hf", "stage4",
                              "--no-ablations"]


def test_offline_wheels_install_without_an_index(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "flashinfer_python-0.5.3-py3-none-any.whl").write_bytes(b"")
    s = run_session(tmp_path, monkeypatch, "--offline-wheels", str(wheels), "--tests-only", "-k", "triton")
    pip = s.commands[0]
    assert pip[:4] == ["python", "-m", "pip", "install"] and "--no-index" in pip and "--no-deps" in pip
    assert pip[-1].endswith("flashinfer_python-0.5.3-py3-none-any.whl")
    assert s.env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / ".gpu" / "site")
    assert s.commands[-1][:3] == ["python", "-m", "pytest"] and s.commands[-1][-3:-1] == ["-k", "triton"]


def test_offline_wheels_folder_without_wheels_is_an_error(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="no .whl files"):
        run_session(tmp_path, monkeypatch, "--offline-wheels", str(tmp_path))
