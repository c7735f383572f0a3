"""Every dim form an exporter writes, in hand-made ONNX files: a dim_param that is no identifier, an unnamed dim,
a dim_value of -1, static dims; `--input` over the file's own; `[dims.NAME]` by the name as written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.frontend.dims import declare_dims, identifier_for
from tensorsmith.compiler.frontend.source import open_source
from tensorsmith.core.errors import ConfigError
from tensorsmith.runtime import load
from tests.conftest import max_relative_error, run_cli


def dim_forms_onnx(path: Path) -> Path:
    """y = relu(a @ w), z = b * b, with a: [-1, 'seq-len', 8] (dim_value -1, a non-identifier name), b: [unnamed,
    'seq-len', 4] (an unnamed dim) and w static."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, "seq-len", 8])
    a.type.tensor_type.shape.dim[0].dim_value = -1
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [None, "seq-len", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    weight = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["h"], name="project"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
        helper.make_node("Mul", ["b", "b"], ["z"], name="square"),
    ]
    graph = helper.make_graph(nodes, "dim_forms", [a, b], [y, z], [onnx.numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_identifiers_for_exporters_dim_names() -> None:
    assert identifier_for("p2o.DynamicDimension.0") == "p2o_DynamicDimension_0"
    assert identifier_for("batch-size") == "batch_size"
    assert identifier_for("N?") == "N"
    assert identifier_for("2d") == "dim_2d"
    assert identifier_for("???") == "dim_"


def test_names_that_map_to_one_identifier_stay_apart_and_identifiers_keep_theirs() -> None:
    config = CompileConfig.create({"source": "m.onnx", "inputs": [
        {"name": "a", "dtype": "float32", "dims": ["batch-size", "batch_size", "seq"]}]})  # fmt: skip
    declared = declare_dims(config)
    assert declared.config.inputs[0].dims == ["batch_size_2", "batch_size", "seq"]
    assert declared.names == {"batch_size_2": "batch-size"}


def test_unnamed_and_minus_one_dims_are_named_after_input_and_axis() -> None:
    config = CompileConfig.create({"source": "m.onnx", "inputs": [
        {"name": "x", "dtype": "float32", "dims": [-1, "?", "", 3]}]})  # fmt: skip
    assert config.inputs[0].dims == ["x_dim0", "x_dim1", "x_dim2", 3]


def test_a_dims_table_for_no_dynamic_dim_is_an_error() -> None:
    config = CompileConfig.create({"source": "m.onnx", "dims": {"sequence": {"max": 8}},
                                   "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 3]}]})  # fmt: skip
    with pytest.raises(ConfigError, match=r"\[dims.sequence\] names no dynamic dim") as caught:
        declare_dims(config)
    assert caught.value.hint and "'batch'" in caught.value.hint


def test_every_dim_form_compiles_runs_and_is_recorded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = dim_forms_onnx(tmp_path / "forms.onnx")
    config = CompileConfig.create({"source": str(source), "targets": ["cpu", "sm_86"],
                                   "dims": {"seq-len": {"min": 1, "opt": 6, "max": 32}}})  # fmt: skip
    with caplog.at_level(logging.WARNING):
        result = compile(config, tmp_path / "out")
    manifest = result.manifest
    assert [record.shape for record in manifest.inputs] == [["a_dim0", "seq_len", 8], ["b_dim0", "seq_len", 4]]
    assert manifest.dim_names == {"seq_len": "seq-len"}
    assert manifest.dims["seq_len"] == {"min": 1, "opt": 6, "max": 32}
    assert manifest.default_dims == ["a_dim0", "b_dim0"]
    announced = [r.getMessage() for r in caplog.records if "no range declared" in r.getMessage()]
    assert len(announced) == 1 and "a_dim0, b_dim0" in announced[0] and "min 1, opt = max = 64" in announced[0]
    engine = next(target for target in manifest.targets if target.name == "sm_86")
    assert engine.status == "built" and engine.engine is not None
    assert engine.engine.profiles[0]["a"] == {"min": (1, 1, 8), "opt": (64, 6, 8), "max": (64, 32, 8)}

    rng = np.random.default_rng(3)
    feeds = {"a": rng.standard_normal((3, 5, 8)).astype(np.float32),
             "b": rng.standard_normal((2, 5, 4)).astype(np.float32)}  # fmt: skip
    expected = onnxruntime.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, feeds)
    with load(tmp_path / "out", backend="onnxruntime") as model:
        outputs = model.run(feeds)
    assert (
        max_relative_error(expected[0], outputs["y"]) <= 1e-4 and max_relative_error(expected[1], outputs["z"]) <= 1e-4
    )


def test_input_flags_replace_the_files_dims_and_tie_dims_together(tmp_path: Path) -> None:
    source = dim_forms_onnx(tmp_path / "forms.onnx")
    config = CompileConfig.create({"source": str(source), "inputs": [
        {"name": "a", "dtype": "float32", "dims": ["batch", "seq-len", 8]},
        {"name": "b", "dtype": "float32", "dims": ["batch", "seq-len", 4]}]})  # fmt: skip
    opened = open_source(config)
    assert [decl.dims for decl in opened.config.inputs] == [["batch", "seq_len", 8], ["batch", "seq_len", 4]]
    assert opened.default_dims == ["batch", "seq_len"]
    assert opened.onnx_model is not None
    assert [d.dim_param for d in opened.onnx_model.graph.input[1].type.tensor_type.shape.dim][:2] == [
        "batch",
        "seq_len",
    ]


def test_the_cli_takes_any_dim_name_in_input_flags(tmp_path: Path) -> None:
    source = dim_forms_onnx(tmp_path / "forms.onnx")
    result = run_cli("compile", source, "-o", tmp_path / "out", "--input", "a:float32:N?,seq-len,8",
                     "--input", "b:float32:N?,seq-len,4", "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["inputs"][0]["shape"] == ["N", "seq_len", 8]
    assert manifest["dim_names"] == {"N": "N?", "seq_len": "seq-len"}
