import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.runtime import ArtifactError, RuntimeLoadError, TensorSpec, load
from tests.conftest import cpu_backend


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import small_mlp_onnx

    directory = tmp_path_factory.mktemp("loader")
    source = small_mlp_onnx(directory / "mlp.onnx")
    config = CompileConfig.create(
        {"source": str(source), "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 8]}]}
    )
    return compile(config, directory / "out").out


def copy_artifact(artifact: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(artifact, tmp_path / "copy"))


def test_onnxruntime_optimizers_the_manifest_switches_off_apply_on_the_cpu(artifact: Path, tmp_path: Path) -> None:
    from tensorsmith.runtime.device import Device
    from tests.conftest import disable_optimizers_for_cpu

    copy = copy_artifact(artifact, tmp_path)
    disable_optimizers_for_cpu(copy, ["SkipLayerNormFusion"])
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    with (
        load(copy, device=Device(None, reason="no CUDA device")) as model,
        load(artifact, backend="onnxruntime") as plain,
    ):
        assert model._backend.disabled_optimizers == ["SkipLayerNormFusion"]  # type: ignore[attr-defined]
        np.testing.assert_array_equal(model.run({"x": x})["y"], plain.run({"x": x})["y"])
    # Measured on a CPU, so not applied where ONNX Runtime may pick CUDA (a GPU without an engine for it).
    with load(copy, device=Device("sm_80")) as model:
        assert model._backend.disabled_optimizers == []  # type: ignore[attr-defined]


def test_load_runs_on_the_cpu_and_says_why(artifact: Path) -> None:
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    session = onnxruntime.InferenceSession(str(artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"x": x})
    with load(artifact) as model:
        assert model.backend == cpu_backend(artifact)
        assert model.fallback_reason is not None and model.fallback_reason.startswith("no CUDA device")
        assert model.inputs == [TensorSpec("x", "float32", ("batch", 8))]
        assert [spec.name for spec in model.outputs] == ["y"]
        np.testing.assert_allclose(model.run({"x": x})["y"], expected, rtol=1e-5, atol=1e-6)  # OpenVINO's, maybe


def test_run_rejects_a_wrong_dtype_naming_the_input(artifact: Path) -> None:
    with load(artifact) as model, pytest.raises(ValueError, match=r"'x' has dtype float64.*x:float32:\[batch,8\]"):
        model.run({"x": np.zeros((2, 8))})


def test_forcing_tensorrt_without_an_engine_raises(artifact: Path) -> None:
    with pytest.raises(RuntimeLoadError, match="cannot load .* on TensorRT: no CUDA device"):
        load(artifact, backend="tensorrt")


def test_a_changed_model_file_is_refused(artifact: Path, tmp_path: Path) -> None:
    copy = copy_artifact(artifact, tmp_path)
    with (copy / "model.onnx").open("ab") as stream:
        stream.write(b"\0")
    with pytest.raises(ArtifactError, match="sha256"):
        load(copy)


@pytest.mark.parametrize("path", ["../outside.onnx", "/etc/passwd"])
def test_a_manifest_path_outside_the_artifact_is_refused(artifact: Path, tmp_path: Path, path: str) -> None:
    copy = copy_artifact(artifact, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["variants"][0]["path"] = path
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="outside the artifact directory"):
        load(copy)


def test_a_manifest_path_through_a_symlink_out_of_the_artifact_is_refused(artifact: Path, tmp_path: Path) -> None:
    copy = copy_artifact(artifact, tmp_path)
    outside = tmp_path / "elsewhere.onnx"
    outside.write_bytes((copy / "model.onnx").read_bytes())
    (copy / "link.onnx").symlink_to(outside)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["variants"][0]["path"] = manifest["model"]["path"] = "link.onnx"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="'link.onnx', which is outside the artifact directory"):
        load(copy)


def test_shapes_outside_the_declared_dims_are_refused_naming_the_input(tmp_path: Path) -> None:
    from tests.conftest import small_mlp_onnx

    source = small_mlp_onnx(tmp_path / "mlp.onnx")
    config = CompileConfig.create({
        "source": str(source), "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 8]}],
        "dims": {"batch": {"min": 2, "opt": 4, "max": 16}},
    })  # fmt: skip
    with load(compile(config, tmp_path / "out").out) as model:
        assert model.run({"x": np.zeros((16, 8), np.float32)})["y"].shape == (16, 4)
        for rows in (1, 17):
            with pytest.raises(ValueError, match=rf"'x' has size {rows} on axis 0 \('batch'\), outside .* 2\.\.16"):
                model.run({"x": np.zeros((rows, 8), np.float32)})


def test_an_unknown_schema_version_is_a_clear_error(artifact: Path, tmp_path: Path) -> None:
    copy = copy_artifact(artifact, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="schema_version 99; this tensorsmith reads versions 1 and 2"):
        load(copy)


def test_a_missing_artifact_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"manifest\.json does not exist"):
        load(tmp_path / "nothing")


def test_run_from_eight_threads_gives_each_its_own_outputs(artifact: Path) -> None:
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((i + 1, 8)).astype(np.float32) for i in range(8)]
    with load(artifact) as model:
        expected = [model.run({"x": x})["y"] for x in batches]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda x: model.run({"x": x})["y"], batches * 4))
    for index, outputs in enumerate(got):
        np.testing.assert_array_equal(outputs, expected[index % 8])
