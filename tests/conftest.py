"""Shared fixtures: tiny real models exported with torch, real ONNX Runtime sessions, and the CLI in-process."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from tensorsmith.cli.main import main


def cpu_backend(artifact: Path) -> str:
    """What a load without a GPU runs: the cpu variant's backend as the compile measured it ("onnxruntime:..." or
    "openvino:..."), since OpenVINO is chosen wherever it timed faster on the machine that compiled."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    cpu = next(target for target in manifest["targets"] if target["name"] == "cpu")
    variant = next(variant for variant in manifest["variants"] if variant["name"] == cpu["variant"])
    return {"onnxruntime": "onnxruntime:CPUExecutionProvider", "openvino": "openvino:CPU"}[variant["backend"]]


def run_cli(*args: str) -> Result:
    """Invoke `tensorsmith ARGS` in-process; stdout and stderr are kept apart (click >= 8.2)."""
    return CliRunner().invoke(main, [str(arg) for arg in args], catch_exceptions=False)


def run_cli_json(*args: str) -> dict:
    result = run_cli(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def cli() -> Callable[..., Result]:
    return run_cli


def small_mlp_onnx(path: Path, opset: int = 14, batch: int = 2) -> Path:
    """A real two-layer MLP exported by torch's TorchScript exporter with a static batch (an 'old' ONNX file)."""
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    torch.onnx.export(
        module, (torch.randn(batch, 8),), str(path), dynamo=False, opset_version=opset, input_names=["x"],
        output_names=["y"],
    )  # fmt: skip
    return path


@pytest.fixture
def mlp_onnx(tmp_path: Path) -> Path:
    return small_mlp_onnx(tmp_path / "mlp.onnx")


def max_relative_error(reference: np.ndarray, actual: np.ndarray) -> float:
    reference = np.asarray(reference, dtype=np.float64)
    return float(np.max(np.abs(np.asarray(actual, dtype=np.float64) - reference)) / np.max(np.abs(reference)))


def compile_small_mlp(directory: Path, name: str = "out", targets: list[str] | None = None) -> Path:
    """The small MLP (opset 17, batch dim dynamic: min 1, opt 4, max 16) compiled into `directory/name`."""
    from tensorsmith.compiler import CompileConfig, compile

    source = small_mlp_onnx(directory / "mlp.onnx", opset=17)
    fields: dict = {
        "source": str(source),
        "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 8]}],
        "dims": {"batch": {"min": 1, "opt": 4, "max": 16}},
    }
    if targets:
        fields["targets"] = targets
    return compile(CompileConfig.create(fields), directory / name).out


def disable_optimizers_for_cpu(artifact: Path, optimizers: list[str]) -> None:
    """Record in the artifact's manifest, as a compile that measured them slower would, ONNX Runtime optimizers
    to switch off for the cpu target's variant (and ONNX Runtime as its backend, which they apply to)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    cpu = next(target["variant"] for target in manifest["targets"] if target["name"] == "cpu")
    for variant in manifest["variants"]:
        if variant["name"] == cpu:
            variant["onnxruntime_disabled_optimizers"] = optimizers
            variant["backend"] = "onnxruntime"
    (artifact / "manifest.json").write_text(json.dumps(manifest))


# Artifacts that several test files read, compiled once per test session, whichever pytest-xdist worker asks
# first (the other waits for it, then reads the same directory): the expensive compiles are shared, never repeated
# file by file or worker by worker. Tests must not write into them.
SAMPLES = Path(__file__).resolve().parents[1] / "samples"
MINILM_INT8_TARGETS = ["sm_80", "sm_86", "sm_89", "sm_120"]


def session_directory(factory: pytest.TempPathFactory) -> Path:
    """The directory of this test session, shared by its xdist workers (each has its own below it)."""
    root = factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session", autouse=True)
def shared_export_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One export cache for the session (compiler/frontend/export_cache.py): tests that compile the same checkpoint
    with the same export settings (tinylm, for one precision after another) export it once. Its own tests pass
    --export-cache, which the variable does not override."""
    from tensorsmith.compiler.frontend.export_cache import ENV_VARIABLE

    directory = session_directory(tmp_path_factory) / "export-cache"
    directory.mkdir(exist_ok=True)
    os.environ[ENV_VARIABLE] = str(directory)
    return directory


def compiled_once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """`name`'s artifact directory, made by `make(out)` by the first worker of this session to ask for it."""
    root = session_directory(factory)
    out, done = root / "compiled-once" / name, root / "compiled-once" / f"{name}.done"
    out.parent.mkdir(parents=True, exist_ok=True)
    with (root / "compiled-once" / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, by the worker that made it or failed
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a failed attempt's
            make(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def tinylm_cpu_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """samples/tinylm's checkpoint compiled for the cpu target, fp32 (its defaults, no evaluation text)."""
    from tensorsmith.compiler import CompileConfig, compile

    config = CompileConfig.create({"source": str(SAMPLES / "tinylm" / "checkpoint"), "targets": ["cpu"]})
    return compiled_once(tmp_path_factory, "tinylm-cpu", lambda out: compile(config, out))


@pytest.fixture(scope="session")
def tinylm_dynamic_cache_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """samples/tinylm for the cpu target with `kv_cache = "dynamic"`: Optimum's and GenAI's growing cache."""
    from tensorsmith.compiler import CompileConfig, compile

    source = str(SAMPLES / "tinylm" / "checkpoint")
    config = CompileConfig.create({"source": source, "targets": ["cpu"], "generation": {"kv_cache": "dynamic"}})
    return compiled_once(tmp_path_factory, "tinylm-dynamic", lambda out: compile(config, out))


@pytest.fixture(scope="session")
def minilm_int8_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 with --precision int8 for the cpu (cpu-int8) and every int8 architecture (int8)."""
    from tensorsmith.samples import prepare

    prepare.prepare("minilm")
    minilm = SAMPLES / "minilm"
    targets = [arg for target in ["cpu", *MINILM_INT8_TARGETS] for arg in ("--target", target)]
    return compiled_once(tmp_path_factory, "minilm-int8", lambda out: run_cli_json(
        "compile", minilm / "tensorsmith.toml", "-o", out, "--precision", "int8",
        "--calibration", minilm / "calibration.npz", "--eval-data", minilm / "evaluation.npz", *targets,
    ))  # fmt: skip
