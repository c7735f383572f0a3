"""The engines stage on its own: a real variant built by tensorrt-rtx, a target no builder here covers recorded
pending with the builder's own reason, and the cpu needing none."""

import json
from pathlib import Path

import pytest

from tensorsmith.compiler.config import BuildConfig
from tensorsmith.compiler.engines.records import build_engines, choose_builder
from tensorsmith.core.errors import BuildError
from tensorsmith.core.ir import io_records, load_onnx
from tensorsmith.core.progress import LogReporter
from tensorsmith.runtime.manifest import VariantRecord, sha256_of
from tests.conftest import small_mlp_onnx


@pytest.fixture
def variant(tmp_path: Path) -> VariantRecord:
    path = small_mlp_onnx(tmp_path / "model.onnx", opset=17)
    return VariantRecord(name="fp32", path="model.onnx", sha256=sha256_of(path), precisions=["fp32"])


def test_each_target_gets_built_pending_or_not_needed(tmp_path: Path, variant: VariantRecord) -> None:
    inputs = io_records(load_onnx(tmp_path / variant.path)).inputs
    targets = ["cpu", "sm_86", "sm_90"]
    records = build_engines(BuildConfig(), targets, dict.fromkeys(targets, variant), inputs, {}, tmp_path,
                            LogReporter())  # fmt: skip
    by_name = {record.name: record for record in records}
    assert by_name["cpu"].status == "not-needed" and by_name["cpu"].builder == "none"
    built = by_name["sm_86"]
    assert built.status == "built" and built.builder == "tensorrt-rtx" and built.engine is not None
    assert built.engine.sha256 == sha256_of(tmp_path / built.engine.path)
    details = json.loads((tmp_path / "engines" / "sm_86.json").read_text())
    assert details["variant"] == "fp32" and isinstance(details["warnings"], list)  # the build's warnings kept
    pending = by_name["sm_90"]
    assert pending.status == "pending" and pending.builder == "tensorrt"  # the table's on-device builder
    assert "no builder for sm_90 is installed here" in pending.reason  # the builder's own reason, kept
    assert "tensorsmith build OUT --target sm_90" in pending.reason


def test_the_cpu_has_no_builder_to_choose() -> None:
    with pytest.raises(BuildError, match="runs on ONNX Runtime"):
        choose_builder("cpu", None)
    assert choose_builder("sm_120", None) == "tensorrt-rtx"
