from pathlib import Path

import pytest

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.flags import parse_input_flag
from tensorsmith.core.errors import ConfigError

TOML = """
source = "pkg.module:build"
checkpoint = "weights.safetensors"

[[inputs]]
name = "input_ids"
dtype = "int64"
dims = ["batch", 128]

[dims.batch]
opt = 8
max = 64
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tensorsmith.toml"
    path.write_text(text)
    return path


def test_toml_is_read_and_relative_paths_resolve_beside_it(tmp_path: Path) -> None:
    config = CompileConfig.from_toml(write(tmp_path, TOML))
    assert config.source_kind == "factory"
    assert config.resolve(config.checkpoint or "") == tmp_path.resolve() / "weights.safetensors"
    assert config.inputs[0].dims == ["batch", 128]
    assert config.example_sizes() == {"batch": 8}
    assert config.opset == 20
    assert config.targets == ["cpu"]


def test_overrides_replace_toml_keys(tmp_path: Path) -> None:
    config = CompileConfig.from_toml(write(tmp_path, TOML), opset=18, checkpoint=None)
    assert config.opset == 18
    assert config.checkpoint is not None  # None means "not given on the command line"


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ("opset = 9\n", "opset", "greater than or equal to 13"),
        ('opset = "twenty"\n', "opset", "valid integer"),
        ("verify = 3\n", "verify", "valid boolean"),
    ],
)
def test_bad_fields_are_named_with_the_file(tmp_path: Path, extra: str, field: str, message: str) -> None:
    path = write(tmp_path, extra + TOML)
    with pytest.raises(ConfigError, match=rf"{path}: field '{field}': .*{message}"):
        CompileConfig.from_toml(path)


def test_a_bad_nested_field_names_its_location(tmp_path: Path) -> None:
    path = write(tmp_path, TOML.replace('dtype = "int64"', 'dtype = "int65"'))
    with pytest.raises(ConfigError, match=r"field 'inputs\.0\.dtype'"):
        CompileConfig.from_toml(path)


def test_dim_ranges_must_be_ordered(tmp_path: Path) -> None:
    path = write(tmp_path, TOML.replace("max = 64", "max = 4"))
    with pytest.raises(ConfigError, match=r"field 'dims\.batch': .*min <= opt <= max"):
        CompileConfig.from_toml(path)


def test_invalid_toml_and_missing_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not valid TOML"):
        CompileConfig.from_toml(write(tmp_path, "source = "))
    with pytest.raises(ConfigError, match="does not exist"):
        CompileConfig.from_toml(tmp_path / "missing.toml")


def test_unknown_targets_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"field 'targets': unknown target 'sm_42'"):
        CompileConfig.create({"source": "m.onnx", "targets": ["sm_42"]})


def test_a_precision_a_target_cannot_run_is_refused_before_any_work() -> None:
    with pytest.raises(ConfigError, match="target sm_86 .* cannot run fp8") as caught:
        CompileConfig.create({"source": "m.onnx", "precision": "fp8", "calibration": "c.npz", "targets": ["sm_86"]})
    assert "sm_89" in str(caught.value)
    with pytest.raises(ConfigError, match="target cpu .* cannot run fp8"):
        CompileConfig.create({"source": "m.onnx", "precision": "fp8", "calibration": "c.npz"})
    config = CompileConfig.create(
        {"source": "m.onnx", "precision": "fp8", "calibration": "c.npz", "targets": ["sm_89", "sm_120"]}
    )
    assert config.targets == ["sm_89", "sm_120"]


def test_quantized_precisions_need_calibration_data() -> None:
    with pytest.raises(ConfigError, match="precision int8 needs calibration data"):
        CompileConfig.create({"source": "m.onnx", "precision": "int8"})


def test_duplicate_inputs_are_refused() -> None:
    declaration = {"name": "x", "dtype": "float32", "dims": [1]}
    with pytest.raises(ConfigError, match=r"inputs declared twice: \['x'\]"):
        CompileConfig.create({"source": "m.onnx", "inputs": [declaration, declaration]})


def test_input_flag_parsing() -> None:
    assert parse_input_flag("input_ids:int64:batch,128") == {
        "name": "input_ids",
        "dtype": "int64",
        "dims": ["batch", 128],
    }
    with pytest.raises(ConfigError, match="NAME:DTYPE:DIMS"):
        parse_input_flag("input_ids:int64")


def test_distinct_default_sizes_for_unconfigured_dynamic_dims() -> None:
    config = CompileConfig.create(
        {"source": "m.onnx", "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", "sequence", 4]}]}
    )
    sizes = config.example_sizes()
    assert sizes["batch"] != sizes["sequence"]
    assert min(sizes.values()) >= 2


def test_a_malformed_budget_fails_with_the_config_before_any_work() -> None:
    with pytest.raises(ConfigError, match=r"field 'budget': budget 'cosine>>1' is not METRIC>=VALUE"):
        CompileConfig.create({"source": "m.onnx", "budget": "cosine>>1"})
    with pytest.raises(ConfigError, match="lower max-abs is better"):
        CompileConfig.create({"source": "m.onnx", "budget": "max-abs>=0.1"})
    config = CompileConfig.create({"source": "m.onnx", "precision": "auto", "calibration": "c.npz",
                                   "budget": "sqnr-db>=30"})  # fmt: skip
    budget = config.accuracy_budget()
    assert budget is not None and str(budget) == "sqnr-db>=30"


def test_an_unknown_key_is_named_with_the_keys_known_there(tmp_path: Path) -> None:
    path = write(tmp_path, 'colour = "red"\n' + TOML)
    with pytest.raises(ConfigError, match=rf"{path}: unknown key 'colour'") as caught:
        CompileConfig.from_toml(path)
    assert "source, checkpoint" in (caught.value.hint or "")
    with pytest.raises(ConfigError, match=r"unknown key 'build.buildr'") as caught:
        CompileConfig.create({"source": "m.onnx", "build": {"buildr": "auto"}})
    assert "builder" in (caught.value.hint or "") and "base_dir" not in str(caught.value)
