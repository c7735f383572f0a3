"""The command line is made from CompileConfig's fields (cli/config_flags.py): each flag's help states its field's
default, its value reaches the field it names (nested tables included), and compile and calibrate share the flags
of a source's graph."""

from pathlib import Path

import click
import pytest

from tensorsmith.cli.calibrate import calibrate_command
from tensorsmith.cli.compile import COMPILE_FLAGS, SOURCE_FLAGS, compile_command
from tensorsmith.cli.config_flags import _shown, default_of, field_info, overrides
from tensorsmith.compiler import CompileConfig

FLAGS = [*SOURCE_FLAGS, *COMPILE_FLAGS]


def _options(command: click.Command) -> dict[str, click.Option]:
    return {param.name: param for param in command.params if isinstance(param, click.Option) and param.name}


@pytest.mark.parametrize("flag", FLAGS, ids=lambda flag: flag.field)
def test_each_flag_s_help_states_its_field_s_default(flag) -> None:  # type: ignore[no-untyped-def]
    option = _options(compile_command)[flag.parameter]
    info = field_info(flag.field)
    shown = _shown(default_of(info))
    assert option.help is not None
    if option.is_flag:  # a switch away from the field's default
        assert option.flag_value is not default_of(info)
        assert ("on by default" in option.help) is (default_of(info) is True)
    elif shown:
        assert option.help.endswith(f"(default: {shown}).")
    else:
        assert "(default: " not in option.help
    assert (info.description or "").rstrip(".")[:40] in option.help


def test_flags_set_the_fields_they_name(tmp_path: Path) -> None:
    arguments = [
        "model.onnx", "-o", str(tmp_path / "out"), "--target", "cpu", "--target", "sm_86", "--precision", "int4",
        "--int4-algorithm", "rtn", "--int4-block-size", "64", "--dim", "batch=1:2:8", "--max-batch", "4",
        "--kv-cache", "dynamic", "--engine-cache", "engines", "--no-fuse", "--no-resource-check",
        "--trace-every-layer", "--calibration-samples", "12", "--input", "x:float32:batch,8",
    ]  # fmt: skip
    with compile_command.make_context("compile", arguments) as context:
        params = dict(context.params)
    found = overrides(FLAGS, {name: params[name] for name in (flag.parameter for flag in FLAGS)})
    assert "opset" not in found and "verify" not in found  # flags left out override nothing
    config = CompileConfig.create({"source": "model.onnx", **found})
    assert config.targets == ["cpu", "sm_86"] and config.precision == "int4" and config.int4_algorithm == "rtn"
    assert config.int4_block_size == 64 and config.calibration_samples == 12
    assert (
        config.dims["batch"].max == 8 and config.generation.max_batch == 4 and config.generation.kv_cache == "dynamic"
    )
    assert config.build.engine_cache_dir == (Path.cwd() / "engines").resolve()
    assert (config.fuse, config.check_resources, config.trace_every_layer, config.verify) == (False, False, True, True)
    assert [decl.name for decl in config.inputs] == ["x"]


def test_compile_and_calibrate_share_the_source_s_flags() -> None:
    compile_options, calibrate_options = _options(compile_command), _options(calibrate_command)
    for flag in SOURCE_FLAGS:
        assert compile_options[flag.parameter].opts == calibrate_options[flag.parameter].opts
        assert compile_options[flag.parameter].help == calibrate_options[flag.parameter].help
