"""select_engine over a table of devices, and load()'s fallback on this CPU-only machine."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.runtime import Device, load, select_engine
from tensorsmith.runtime.manifest import read_manifest
from tests.conftest import cpu_backend, small_mlp_onnx

RTX = "1.7.1.116"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("selection")
    source = small_mlp_onnx(directory / "mlp.onnx", opset=17)
    config = CompileConfig.create(
        {
            "source": str(source),
            "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 8]}],
            "targets": ["cpu", "sm_86", "sm_89", "sm_90"],
        }
    )
    return compile(config, directory / "out").out


def copy(artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "copy"))


CASES = [
    # (device, expected target or None, words the reason must contain)
    (Device("sm_86", tensorrt={"tensorrt-rtx": RTX}), "sm_86", ""),
    (Device("sm_89", tensorrt={"tensorrt-rtx": RTX, "tensorrt": "10.13.0"}), "sm_89", ""),
    (Device(None, reason="no CUDA device"), None, "no CUDA device"),
    (Device("sm_80", tensorrt={"tensorrt-rtx": RTX}), None, "no engine for sm_80"),
    (Device("sm_90", tensorrt={"tensorrt": "10.13.0"}), None, "no engine for sm_90"),  # pending, not built
    (Device("sm_120", tensorrt={"tensorrt-rtx": RTX}), None, "no engine for sm_120"),
    (Device("sm_86", tensorrt={"tensorrt": "10.13.0"}), None, "needs tensorrt-rtx, which is not installed"),
    (Device("sm_86", tensorrt={"tensorrt-rtx": "1.8.0.1"}), None, "1.8.0.1 is installed"),
]


@pytest.mark.parametrize(("device", "expected", "reason"), CASES)
def test_select_engine(artifact: Path, device: Device, expected: str | None, reason: str) -> None:
    selection = select_engine(read_manifest(artifact), device, artifact)
    assert (selection.target.name if selection.target else None) == expected
    assert reason in selection.reason
    if expected:
        assert selection.path == (artifact / "engines" / f"{expected}.engine").resolve()


def test_a_tampered_engine_is_refused(artifact: Path, tmp_path: Path) -> None:
    tampered = copy(artifact, tmp_path)
    with (tampered / "engines" / "sm_86.engine").open("r+b") as stream:
        stream.seek(100)
        stream.write(b"\xff\xfe")
    selection = select_engine(read_manifest(tampered), Device("sm_86", tensorrt={"tensorrt-rtx": RTX}), tampered)
    assert selection.target is None and "does not match its sha256" in selection.reason


def test_a_truncated_engine_is_refused_and_load_falls_back_saying_why(artifact: Path, tmp_path: Path) -> None:
    truncated = copy(artifact, tmp_path)
    engine = truncated / "engines" / "sm_86.engine"
    engine.write_bytes(engine.read_bytes()[: engine.stat().st_size // 2])
    device = Device("sm_86", tensorrt={"tensorrt-rtx": RTX})
    selection = select_engine(read_manifest(truncated), device, truncated)
    assert selection.target is None and "does not match its sha256" in selection.reason
    with load(truncated, device=device) as model:  # a GPU without its engine: ONNX Runtime, never OpenVINO
        assert model.backend.startswith("onnxruntime") and "does not match its sha256" in str(model.fallback_reason)


def test_a_missing_engine_is_refused(artifact: Path, tmp_path: Path) -> None:
    missing = copy(artifact, tmp_path)
    (missing / "engines" / "sm_89.engine").unlink()
    selection = select_engine(read_manifest(missing), Device("sm_89", tensorrt={"tensorrt-rtx": RTX}), missing)
    assert selection.target is None and "is missing" in selection.reason


def test_an_engine_path_outside_the_artifact_is_refused(artifact: Path, tmp_path: Path) -> None:
    escaped = copy(artifact, tmp_path)
    manifest = json.loads((escaped / "manifest.json").read_text())
    next(t for t in manifest["targets"] if t["name"] == "sm_86")["engine"]["path"] = "../../etc/passwd"
    (escaped / "manifest.json").write_text(json.dumps(manifest))
    selection = select_engine(read_manifest(escaped), Device("sm_86", tensorrt={"tensorrt-rtx": RTX}), escaped)
    assert selection.target is None and "outside the artifact directory" in selection.reason


def test_the_manifest_records_built_and_pending_targets(artifact: Path) -> None:
    targets = {t.name: t for t in read_manifest(artifact).targets}
    assert targets["sm_86"].status == targets["sm_89"].status == "built"
    assert targets["sm_90"].status == "pending" and "Hopper" in targets["sm_90"].reason
    record = json.loads((artifact / "engines" / "sm_89.json").read_text())
    assert record["builder"] == "tensorrt-rtx" and record["compute_capability"] == "sm_89"


def test_load_on_this_cpu_machine_falls_back_with_the_reason(artifact: Path) -> None:
    with load(artifact) as model:
        assert model.backend == cpu_backend(artifact)
        assert model.fallback_reason is not None and model.fallback_reason.startswith("no CUDA device")
        assert model.run({"x": np.ones((2, 8), np.float32)})["y"].shape == (2, 4)


@pytest.mark.gpu
def test_load_runs_the_engine_on_a_gpu(artifact: Path) -> None:
    """Only on a machine with an NVIDIA GPU (scripts/gpu-check.sh): the engine for it, or the reason."""
    from tensorsmith.runtime import detect_device

    device = detect_device()
    if device.compute_capability is None:
        pytest.skip(device.reason)
    with load(artifact) as model:
        print(f"{device}: {model.backend} ({model.fallback_reason})")
        outputs = model.run({"x": np.ones((2, 8), np.float32)})
    assert outputs["y"].shape == (2, 4)


def test_a_directory_of_type_stubs_is_not_an_installed_tensorrt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tensorrt-stubs installs tensorrt/__init__.pyi, which imports as an empty namespace package."""
    from tensorsmith.runtime.device import installed_tensorrt

    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "__init__.pyi").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "tensorrt" not in installed_tensorrt()
