"""The target table: one row per architecture decides precisions, recipes, builders and batch limits."""

import dataclasses
from pathlib import Path

import pytest

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.targets import RTX_TARGETS, TARGETS, Recipe, Target, check_precision, get_target
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan
from tensorsmith.core.errors import ArtifactError, ConfigError
from tensorsmith.core.precisions import BF16, FP16, FP32, INT4, INT8, NVFP4
from tensorsmith.runtime.backends import ONNX_RUNTIME, TENSORRT


@pytest.mark.parametrize(
    ("target", "request_", "variant"),
    [
        ("cpu", "fp32", "fp32"),
        ("cpu", "int8", "cpu-int8"),
        ("cpu", "auto", "cpu-int8"),
        ("sm_75", "fp32", "fp16"),  # no fp32 GEMM on Turing with TensorRT for RTX
        ("sm_75", "auto", "int8"),
        ("sm_86", "fp32", "fp32"),
        ("sm_86", "fp16", "fp16"),
        ("sm_86", "auto", "int8"),
        ("sm_89", "auto", "fp8"),
        ("sm_90", "int8", "int8"),
        ("sm_120", "fp8", "fp8"),
    ],
)
def test_each_request_gives_each_target_one_recipe(target: str, request_: str, variant: str) -> None:
    assert get_target(target).recipe(request_).variant == variant  # type: ignore[arg-type]


def test_recipes_name_their_variants() -> None:
    assert Recipe(None, FP16).variant == "fp16"
    assert Recipe(INT8, FP16).variant == "int8"
    assert Recipe(INT8, FP32, ONNX_RUNTIME).variant == "cpu-int8"
    assert Recipe(INT4, BF16).variant == "int4-bf16"


def test_recipes_name_their_backend() -> None:
    """The backend is the row's (TensorRT for a GPU, ONNX Runtime for the cpu), never inferred from a float."""
    assert get_target("cpu").recipe("int4").backend is ONNX_RUNTIME
    assert get_target("sm_86").recipe("fp32").backend is TENSORRT
    assert get_target("cpu").recipe("int4").on_cpu and not get_target("sm_86").recipe("int4").on_cpu


@pytest.mark.parametrize(
    ("target", "request_", "variant", "fallback"),
    [
        ("sm_75", "bf16", "fp16", "sm_75 (Turing) has no bf16 kernels: fp16 instead"),
        ("sm_86", "bf16", "bf16", None),
        ("cpu", "bf16", "fp32", None),
        ("sm_89", "nvfp4", "fp16", "sm_89 (Ada) has no nvfp4 kernels: fp16 instead"),
        ("sm_120", "nvfp4", "nvfp4", None),
        ("sm_75", "int4", "fp16", "sm_75 (Turing) has no int4 kernels: fp16 instead"),
    ],
)
def test_new_precisions_come_from_the_table(target: str, request_: str, variant: str, fallback: str | None) -> None:
    row = get_target(target)
    assert row.recipe(request_).variant == variant
    assert row.fallback(request_) == fallback


@pytest.mark.parametrize(
    ("target", "request_", "variant"),
    [("sm_89", "nvfp4", "bf16"), ("sm_86", "fp8-weight", "bf16"), ("sm_75", "int4", "fp16"), ("cpu", "nvfp4", "fp32")],
)
def test_a_bf16_checkpoint_s_targets_fall_back_to_bf16_where_they_run_it(
    target: str, request_: str, variant: str
) -> None:
    """A weight-only request a target cannot run gives the checkpoint's float type, as the target would get alone."""
    row = get_target(target)
    assert row.recipe(request_, floats=BF16).variant == variant
    assert row.fallback(request_, floats=BF16).endswith(f": {variant} instead")  # type: ignore[union-attr]


def test_the_rows_precisions_are_the_tables() -> None:
    assert get_target("sm_75").precisions == ("fp16", "int8", "int8-weight")
    assert "bf16" in get_target("sm_86").precisions and "nvfp4" not in get_target("sm_89").precisions
    assert get_target("sm_120").runs_precision(NVFP4) and not get_target("cpu").runs_precision(BF16)
    with pytest.raises(ConfigError, match=r"target sm_86 .* cannot run nvfp4") as caught:
        check_precision("nvfp4", ["sm_86"])
    assert "sm_120" in (caught.value.hint or "")


def test_builders_follow_the_row() -> None:
    assert get_target("cpu").builders == ()
    assert get_target("sm_86").builders == ("tensorrt-rtx", "tensorrt")
    assert get_target("sm_90").builders == ("tensorrt",)
    assert get_target("sm_90").on_device_builder == "tensorrt"
    assert RTX_TARGETS == ("sm_75", "sm_80", "sm_86", "sm_89", "sm_120", "sm_121")
    assert {name: TARGETS[name].max_batch for name in ("sm_75", "sm_86", "sm_80", "sm_90")} == {
        "sm_75": 32, "sm_86": 64, "sm_80": 128, "sm_90": 256,
    }  # fmt: skip


def test_a_precision_a_target_cannot_run_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"target sm_86 .* cannot run fp8") as caught:
        check_precision("fp8", ["sm_89", "sm_86"])
    assert "sm_89" in (caught.value.hint or "")
    check_precision("fp32", ["sm_75"])  # served by the fp16 variant
    check_precision("auto", list(TARGETS))


def test_a_new_row_is_all_a_new_target_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row added to the table is accepted by the config and gets its recipe and builders from the row alone."""
    row = dataclasses.replace(TARGETS["sm_89"], name="sm_99", gpus="a future part", rtx_capability=None)
    monkeypatch.setitem(TARGETS, "sm_99", row)
    config = CompileConfig.create({"source": "m.onnx", "targets": ["sm_99"], "precision": "fp16"})
    assert config.targets == ["sm_99"]
    assert isinstance(get_target("sm_99"), Target)
    assert get_target("sm_99").recipe("auto").variant == "fp8"
    assert get_target("sm_99").builders == ("tensorrt",)


def test_precision_json_s_fallback_is_a_float_precision(tmp_path: Path) -> None:
    (tmp_path / "precision.json").write_text('{"precision": "fp8-weight", "fallback_float": "int4"}')
    with pytest.raises(ArtifactError, match=r"field 'fallback_float': .*'int4' is not a float precision"):
        PrecisionPlan.read(tmp_path)
    (tmp_path / "precision.json").write_text('{"precision": "fp8-weight"}')  # written before it was recorded
    plan = PrecisionPlan.read(tmp_path)
    assert plan is not None and plan.fallback_float == "fp16"
