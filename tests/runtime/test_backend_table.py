"""Backends are rows of one table (runtime/backends.py): a new one is a module with `open_backend` and one row, and
`load()`, the manifest and the error messages take it from there. The fake here runs the cpu variant with onnx's
reference evaluator, a real second implementation of the graph."""

import ast
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.runtime import InputError, load
from tensorsmith.runtime import backends as table
from tensorsmith.runtime.backends import ONNX_RUNTIME, BackendSpec
from tensorsmith.runtime.device import Device
from tensorsmith.runtime.manifest import read_manifest

REFERENCE_BACKEND = '''
"""The cpu variant run by onnx's reference evaluator."""
from onnx.reference import ReferenceEvaluator

from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.errors import BackendUnavailable


class ReferenceBackend(Backend):
    name = "onnx-reference"

    def __init__(self, path, inputs, outputs):
        super().__init__(inputs, outputs)
        self._evaluator = ReferenceEvaluator(str(path))

    def _run_impl(self, feeds):
        names = [spec.name for spec in self.outputs]
        return dict(zip(names, self._evaluator.run(names, feeds)))


def open_backend(artifact):
    if artifact.static_cache:
        raise BackendUnavailable("the reference evaluator updates no cache in place")
    path, _ = artifact.cpu_variant()
    return ReferenceBackend(path, artifact.inputs, artifact.outputs)
'''
CPU = Device(None, reason="no CUDA device")
PRODUCT = ("core", "compiler", "passes", "calibration", "runtime", "serve", "cli", "samples")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import small_mlp_onnx

    directory = tmp_path_factory.mktemp("backends")
    source = small_mlp_onnx(directory / "mlp.onnx")
    config = CompileConfig.create(
        {"source": str(source), "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 8]}], "targets": ["cpu"]}
    )
    return compile(config, directory / "out").out


@pytest.fixture
def reference_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BackendSpec:
    """The fake backend: its module under a temporary directory, its row added to the table."""
    (tmp_path / "reference_backend.py").write_text(REFERENCE_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    row = BackendSpec("onnx-reference", "ONNX's reference evaluator", runs_engines=False, module="reference_backend")
    monkeypatch.setattr(table, "BACKENDS", [*table.BACKENDS, row])
    return row


def test_a_backend_added_by_one_module_and_one_row_runs_the_artifact(
    artifact: Path, reference_row: BackendSpec
) -> None:
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    session = onnxruntime.InferenceSession(str(artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"x": x})
    with load(artifact, backend=reference_row.name, device=CPU) as model:
        assert model.backend == "onnx-reference" and model.fallback_reason is None
        np.testing.assert_allclose(model.run({"x": x})["y"], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="unknown backend 'onnx-refrence' .did you mean onnx-reference"):
        load(artifact, backend="onnx-refrence", device=CPU)


def test_auto_runs_the_backend_the_manifest_records(artifact: Path, reference_row: BackendSpec, tmp_path: Path) -> None:
    """A compile that measured the new backend fastest records its name; `load()` then runs the cpu variant there,
    and falls back to the default cpu row, saying why, when it cannot."""
    copy = Path(shutil.copytree(artifact, tmp_path / "copy"))
    manifest = json.loads((copy / "manifest.json").read_text())
    cpu = next(target["variant"] for target in manifest["targets"] if target["name"] == "cpu")
    for variant in manifest["variants"]:
        if variant["name"] == cpu:
            variant["backend"] = reference_row.name
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(copy).variant(cpu).backend == reference_row.name  # the table's row is a name it takes
    with load(copy, device=CPU) as model:
        assert model.backend == "onnx-reference"
        assert model.fallback_reason is not None and model.fallback_reason.startswith("no CUDA device")
    unavailable = "from tensorsmith.runtime.errors import BackendUnavailable as U\n"
    (tmp_path / "reference_backend.py").write_text(
        unavailable + "def open_backend(a):\n    raise U('not installed here')\n"
    )
    sys.modules.pop("reference_backend", None)
    with load(copy, device=CPU) as model:
        assert model.backend.startswith(ONNX_RUNTIME.name)
        assert model.fallback_reason is not None
        assert (
            f"the compile chose ONNX's reference evaluator for {cpu}, but not installed here" in model.fallback_reason
        )


def test_the_cpu_backends_names_are_spelled_in_the_table() -> None:
    """ "onnxruntime" and "openvino" as strings in at most two product files: the table, and the export cache's list
    of packages whose versions key it ("tensorrt" is also a builder's name, a table of its own)."""
    root = Path(__file__).parents[2]
    for spec in table.cpu_backends():
        spelled = {
            str(path.relative_to(root))
            for folder in PRODUCT
            for path in (root / folder).rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and node.value == spec.name
        }
        assert "runtime/backends.py" in spelled and len(spelled) <= 2, (spec.name, sorted(spelled))
