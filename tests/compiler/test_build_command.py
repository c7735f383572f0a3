"""`tensorsmith build OUT --target`: engines added to an existing artifact, concurrently, atomically."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tensorsmith.cli.output import USAGE
from tensorsmith.runtime.manifest import read_manifest
from tests.conftest import compile_small_mlp, run_cli, run_cli_json, small_mlp_onnx


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    return compile_small_mlp(tmp_path)


def test_build_adds_an_engine_with_the_compile_time_profile(artifact: Path) -> None:
    built = run_cli_json("build", artifact, "--target", "sm_86")
    assert built["status"] == "built" and built["builder"] == "tensorrt-rtx" and built["variant"] == "fp32"
    assert built["engine"]["profiles"] == [{"x": {"min": [1, 8], "opt": [4, 8], "max": [16, 8]}}]
    targets = {t.name: t for t in read_manifest(artifact).targets}
    assert set(targets) == {"cpu", "sm_86"}
    assert (artifact / "engines" / "sm_86.engine").is_file()


@pytest.mark.slow
def test_concurrent_builds_for_different_targets_all_land(artifact: Path) -> None:
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tensorsmith.cli.main", "build", str(artifact), "--target", target, "--json"],
            stdout=subprocess.PIPE,
        )
        for target in ("sm_80", "sm_86", "sm_89", "sm_120")
    ]
    for process in processes:
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0 and json.loads(out)["status"] == "built"
    targets = {t.name for t in read_manifest(artifact).targets if t.status == "built"}
    assert targets == {"sm_80", "sm_86", "sm_89", "sm_120"}


def test_a_target_no_installed_builder_covers_is_a_clear_error(artifact: Path) -> None:
    result = run_cli("build", artifact, "--target", "sm_90")
    assert result.exit_code == 1
    assert "sm_90" in result.stderr and "hint:" in result.stderr
    assert read_manifest(artifact).targets[0].name == "cpu"


def test_an_unknown_target_is_refused(artifact: Path) -> None:
    result = run_cli("build", artifact, "--target", "sm_42")
    assert result.exit_code == USAGE and "unknown target 'sm_42' (hint: targets are cpu, sm_75" in result.stderr


@pytest.mark.parametrize(("precision", "variant"), [("fp16", "fp16"), ("fp32", "fp32")])
def test_build_gives_a_new_target_the_variant_compile_would_have(tmp_path: Path, precision: str, variant: str) -> None:
    """sm_75 makes both artifacts hold fp32 and fp16 variants; only compile's --precision (in precision.json)
    tells which one a new sm_86 target gets."""
    from tensorsmith.compiler import CompileConfig, compile

    source = small_mlp_onnx(tmp_path / "mlp.onnx", opset=17)
    config = CompileConfig.create({"source": str(source), "inputs": [{"name": "x", "dtype": "float32",
                                   "dims": ["batch", 8]}], "precision": precision, "targets": ["sm_75"]})  # fmt: skip
    artifact = compile(config, tmp_path / "out").out
    assert [v.name for v in read_manifest(artifact).variants] == ["fp32", "fp16"]
    built = run_cli_json("build", artifact, "--target", "sm_86")
    assert built["status"] == "built" and built["variant"] == variant
