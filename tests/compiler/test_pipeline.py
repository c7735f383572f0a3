"""compile() end to end on small real models: each source kind, the exporter fallback, atomic artifacts."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.core.errors import ConfigError, ExportError, TensorsmithError
from tensorsmith.runtime import load
from tests.conftest import max_relative_error, small_mlp_onnx


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x)) * 2


class DataDependent(torch.nn.Module):
    """Python control flow on a tensor's value: dynamo cannot export it, the TorchScript tracer can."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.sum() > 0:
            return y * 2
        return y


def build_scaled() -> Scaled:
    return Scaled()


def build_data_dependent() -> DataDependent:
    return DataDependent()


def build_not_a_module() -> str:
    return "nope"


X = [{"name": "x", "dtype": "float32", "dims": ["batch", 6]}]


def config(source: str, **fields: object) -> CompileConfig:
    return CompileConfig.create({"source": source, "inputs": X, **fields})


def run_both(out: Path, module: torch.nn.Module, batch: int = 5) -> float:
    x = np.random.default_rng(3).standard_normal((batch, 6)).astype(np.float32)
    with load(out) as model:
        (actual,) = model.run({"x": x}).values()
    with torch.inference_mode():
        expected = module(torch.from_numpy(x)).numpy()
    return max_relative_error(expected, actual)


def test_factory_exports_with_dynamo_and_dynamic_batch(tmp_path: Path) -> None:
    result = compile(config("tests.compiler.test_pipeline:build_scaled"), tmp_path / "out")
    manifest = result.manifest
    assert manifest.source.exporter == "dynamo"
    assert manifest.source.fallback_reason is None
    assert manifest.inputs[0].shape == ["batch", 6]
    assert manifest.passes[0].name == "canonicalize"
    assert manifest.variants[0].accuracy["max_relative_error"] < 1e-5
    assert run_both(result.out, Scaled(), batch=9) < 1e-5


def test_dynamo_failure_falls_back_to_torchscript_and_says_why(tmp_path: Path) -> None:
    result = compile(config("tests.compiler.test_pipeline:build_data_dependent"), tmp_path / "out")
    assert result.manifest.source.exporter == "torchscript"
    assert result.manifest.source.fallback_reason is not None
    assert result.manifest.source.fallback_reason.startswith("dynamo:")
    saved = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert saved["source"]["exporter"] == "torchscript"


def test_exported_program_source(tmp_path: Path) -> None:
    batch = torch.export.Dim("batch")
    program = torch.export.export(Scaled().eval(), (torch.randn(4, 6),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(tmp_path / "model.pt2"))
    result = compile(config(str(tmp_path / "model.pt2")), tmp_path / "out")
    assert result.manifest.source.kind == "exported_program"
    assert result.manifest.source.exporter == "dynamo"
    assert run_both(result.out, Scaled(), batch=7) < 1e-5


def test_onnx_source_gets_its_opset_upgraded_and_declared_dims(tmp_path: Path) -> None:
    source = small_mlp_onnx(tmp_path / "old.onnx", opset=14, batch=2)
    result = compile(
        CompileConfig.create(
            {"source": str(source), "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 8]}]}
        ),
        tmp_path / "out",
    )
    manifest = result.manifest
    assert manifest.source.kind == "onnx" and manifest.source.opset == 14
    assert manifest.passes[0].details == {"opset_before": 14, "opset_after": 20, "folded_by": "onnxscript"}
    compiled = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert compiled.opset_import[0].version == 20
    x = np.ones((5, 8), np.float32)  # batch 5, where the source was exported with batch 2
    with load(result.out) as model:
        assert model.run({"x": x})["y"].shape == (5, 4)


def test_onnx_source_without_declarations_keeps_its_inputs(tmp_path: Path) -> None:
    source = small_mlp_onnx(tmp_path / "old.onnx")
    result = compile(CompileConfig.create({"source": str(source)}), tmp_path / "out")
    assert [(i.name, i.shape) for i in result.manifest.inputs] == [("x", [2, 8])]


def test_declared_input_that_the_onnx_lacks_is_named(tmp_path: Path) -> None:
    source = small_mlp_onnx(tmp_path / "old.onnx")
    bad = CompileConfig.create({"source": str(source), "inputs": [{"name": "z", "dtype": "float32", "dims": [2, 8]}]})
    with pytest.raises(ConfigError, match=r"has no input 'z'.*\['x'\]"):
        compile(bad, tmp_path / "out")


def test_factory_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot import 'no_such_package.models'"):
        compile(config("no_such_package.models:build"), tmp_path / "a")
    with pytest.raises(ConfigError, match="has no callable 'missing'"):
        compile(config("tests.compiler.test_pipeline:missing"), tmp_path / "b")
    with pytest.raises(ExportError, match="returned a str, not a torch.nn.Module"):
        compile(config("tests.compiler.test_pipeline:build_not_a_module"), tmp_path / "c")
    with pytest.raises(ConfigError, match="needs its inputs declared"):
        compile(CompileConfig.create({"source": "tests.compiler.test_pipeline:build_scaled"}), tmp_path / "d")
    assert not any(tmp_path.iterdir()), "a failed compile leaves nothing behind"


def test_a_failed_compile_leaves_the_previous_artifact_intact(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile(config("tests.compiler.test_pipeline:build_scaled"), out)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    (tmp_path / "broken.onnx").write_bytes(b"\x08\x07garbage")
    with pytest.raises(TensorsmithError):
        compile(CompileConfig.create({"source": str(tmp_path / "broken.onnx")}), out)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.onnx", "out"], "no temporary directory is left"


def test_recompiling_replaces_the_artifact(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile(config("tests.compiler.test_pipeline:build_scaled"), out)
    result = compile(config("tests.compiler.test_pipeline:build_data_dependent", exporter="torchscript"), out)
    assert json.loads((out / "manifest.json").read_text())["source"]["exporter"] == "torchscript"
    assert result.manifest.source.path.endswith("build_data_dependent")


def test_a_directory_that_is_not_an_artifact_is_never_replaced(tmp_path: Path) -> None:
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="without manifest.json: not written by tensorsmith"):
        compile(config("tests.compiler.test_pipeline:build_scaled"), precious)
    assert (precious / "notes.txt").read_text() == "keep me"
    # said before the source is even loaded (a checkpoint's export takes minutes): this factory does not exist
    with pytest.raises(ConfigError, match="not written by tensorsmith"):
        compile(config("tests.compiler.test_pipeline:no_such_factory"), precious)


class _StoppedBeforeTheExport(Exception):
    pass


def test_auto_without_a_budget_says_which_budget_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tensorsmith.compiler import pipeline

    def stop(*args: object, **kwargs: object) -> None:
        raise _StoppedBeforeTheExport

    monkeypatch.setattr(pipeline, "fused_graph", stop)
    source = small_mlp_onnx(tmp_path / "mlp.onnx")
    np.savez(tmp_path / "c.npz", x=np.ones((4, 8), np.float32))
    fields = {"source": str(source), "precision": "auto", "calibration": str(tmp_path / "c.npz")}
    with pytest.raises(_StoppedBeforeTheExport):
        compile(CompileConfig.create(fields), tmp_path / "out")
    assert "--precision auto without --budget: the budget is cosine>=0.995 (the default)" in caplog.text
    caplog.clear()
    with pytest.raises(_StoppedBeforeTheExport):
        compile(CompileConfig.create({**fields, "budget": "cosine>=0.99"}), tmp_path / "out")
    assert "without --budget" not in caplog.text
