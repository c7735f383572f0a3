"""Real engine builds with TensorRT for RTX (no GPU needed)."""

from pathlib import Path

import pytest
from onnx import TensorProto, helper, save

from tensorsmith.compiler.config import DimRange
from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import Profile, profile_for
from tensorsmith.core.errors import BuildError
from tensorsmith.runtime.manifest import TensorRecord
from tests.conftest import small_mlp_onnx

STATIC_PROFILE = Profile({"x": ((2, 8), (2, 8), (2, 8))})


def test_profile_from_declared_dims_and_defaults() -> None:
    inputs = [TensorRecord(name="ids", dtype="int64", shape=["batch", "sequence", 4])]
    profile = profile_for(inputs, {"batch": DimRange(min=1, opt=8, max=32)})
    assert profile.shapes["ids"] == ((1, 1, 4), (8, 64, 4), (32, 64, 4))


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_89", "sm_120"])
def test_builds_an_engine_for_each_architecture(tmp_path: Path, target: str) -> None:
    engine = build_engine(small_mlp_onnx(tmp_path / "mlp.onnx", opset=17), target, STATIC_PROFILE)
    assert engine.builder == "tensorrt-rtx"
    assert engine.compute_capability == target
    assert len(engine.plan) > 1000
    assert engine.builder_version.startswith("1.")


def test_a_target_tensorrt_rtx_cannot_build_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="tensorrt-rtx does not build for sm_90"):
        build_engine(small_mlp_onnx(tmp_path / "mlp.onnx"), "sm_90", STATIC_PROFILE)


def test_a_parse_failure_names_the_node(tmp_path: Path) -> None:
    """ONNX Runtime's contrib ops (com.microsoft) are what TensorRT's parser cannot import."""
    node = helper.make_node("FastGelu", ["x"], ["y"], name="ort_fused_gelu", domain="com.microsoft")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    save(model, str(tmp_path / "contrib.onnx"))
    with pytest.raises(BuildError, match=r"could not parse .*node 'ort_fused_gelu' \(FastGelu\)"):
        build_engine(tmp_path / "contrib.onnx", "sm_86", STATIC_PROFILE)


def test_batch_defaults_follow_the_architecture() -> None:
    inputs = [TensorRecord(name="x", dtype="float32", shape=["batch", 8])]
    assert profile_for(inputs, {}, "sm_86").shapes["x"][2] == (64, 8)
    assert profile_for(inputs, {}, "sm_90").shapes["x"][2] == (256, 8)  # Hopper serves larger batches
    assert profile_for(inputs, {"batch": DimRange(max=16)}, "sm_90").shapes["x"][2] == (16, 8)  # config wins


def test_builder_options_are_applied(tmp_path: Path) -> None:
    from tensorsmith.compiler.config import BuildConfig

    options = BuildConfig(optimization_level=1, workspace_mb=64, hardware_compatibility="ampere+",
                          timing_cache_dir=tmp_path / "cache")  # fmt: skip
    engine = build_engine(small_mlp_onnx(tmp_path / "mlp.onnx", opset=17), "sm_86", STATIC_PROFILE, options=options)
    assert len(engine.plan) > 0
    assert engine.timing_cache == {"status": "not used: TensorRT for RTX makes timing caches no-ops"}
    assert not (tmp_path / "cache").exists()
