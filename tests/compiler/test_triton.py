"""`tensorsmith export-triton`: a Triton model repository entry whose config.pbtxt parses with Triton's own
protobuf schema (tritonclient's model_config_pb2)."""

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from tests.conftest import compile_small_mlp, disable_optimizers_for_cpu, run_cli, run_cli_json


def parse_config(model_directory: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse((model_directory / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    return compile_small_mlp(tmp_path, "mlp", ["cpu", "sm_86", "sm_90"])


def test_engine_target_becomes_a_tensorrt_plan_model(artifact: Path, tmp_path: Path) -> None:
    result = run_cli_json("export-triton", artifact, "--target", "sm_86", "-o", tmp_path / "repo")
    assert result["warnings"] and "TensorRT for RTX" in result["warnings"][0]  # Triton loads data-centre engines
    config = parse_config(tmp_path / "repo" / "mlp")
    assert config.name == "mlp" and config.platform == "tensorrt_plan"
    assert config.max_batch_size == 16  # the engine profile's max
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("x", model_config_pb2.TYPE_FP32, [8])]
    assert [(t.name, list(t.dims)) for t in config.output] == [("y", [4])]
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 15000
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    engine = (artifact / "engines" / "sm_86.engine").read_bytes()
    assert (tmp_path / "repo" / "mlp" / "1" / "model.plan").read_bytes() == engine


def test_cpu_target_becomes_an_onnxruntime_model(artifact: Path, tmp_path: Path) -> None:
    run_cli_json(
        "export-triton", artifact, "--target", "cpu", "-o", tmp_path / "repo", "--name", "mlp_cpu",
        "--max-batch", "8", "--max-queue-delay-us", "500", "--instances", "2",
    )  # fmt: skip
    config = parse_config(tmp_path / "repo" / "mlp_cpu")
    assert config.platform == "onnxruntime_onnx" and config.max_batch_size == 8
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert config.instance_group[0].count == 2
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert (tmp_path / "repo" / "mlp_cpu" / "1" / "model.onnx").is_file()


def test_session_settings_the_config_cannot_carry_are_a_warning(artifact: Path, tmp_path: Path) -> None:
    disable_optimizers_for_cpu(artifact, ["SkipLayerNormFusion"])
    result = run_cli_json("export-triton", artifact, "--target", "cpu", "-o", tmp_path / "repo")
    assert any("SkipLayerNormFusion" in warning for warning in result["warnings"])


def test_export_again_replaces_the_model_atomically(artifact: Path, tmp_path: Path) -> None:
    for batch in ("16", "2"):
        run_cli_json("export-triton", artifact, "--target", "sm_86", "-o", tmp_path / "repo", "--max-batch", batch)
    assert parse_config(tmp_path / "repo" / "mlp").max_batch_size == 2
    assert sorted(path.name for path in (tmp_path / "repo").iterdir()) == ["mlp"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--target", "sm_90"], "is pending: no engine to export"),
        (["--target", "sm_75"], "has no target 'sm_75'"),
        (["--target", "sm_86", "--max-batch", "64"], "larger than the sm_86 model's largest batch (16)"),
    ],
)
def test_what_cannot_be_exported_is_a_clear_error(
    artifact: Path, tmp_path: Path, arguments: list[str], message: str
) -> None:
    result = run_cli("export-triton", artifact, "-o", tmp_path / "repo", *arguments)
    assert result.exit_code == 1 and message in result.stderr
    assert not (tmp_path / "repo" / "mlp").exists()


def test_a_directory_triton_did_not_get_from_us_is_not_replaced(artifact: Path, tmp_path: Path) -> None:
    (tmp_path / "repo" / "mlp").mkdir(parents=True)
    (tmp_path / "repo" / "mlp" / "notes.txt").write_text("mine")
    result = run_cli("export-triton", artifact, "--target", "cpu", "-o", tmp_path / "repo")
    assert result.exit_code == 1 and "without config.pbtxt" in result.stderr
    assert (tmp_path / "repo" / "mlp" / "notes.txt").read_text() == "mine"
