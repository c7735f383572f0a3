"""The cpu target runs the fp32 reference where its quantized variant quantizes nothing or misses a budget the
reference meets (compiler/variants/fallback.py): the compile meets its budget, exits 0, ships no variant named for a
precision it does not hold, and says why in the summary, precision.json and the report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tensorsmith.compiler.variants.fallback import cpu_float_instead
from tensorsmith.compiler.variants.precision_plan import LayerChoice, PrecisionPlan, RecipePlan
from tensorsmith.compiler.variants.stage import Variants, reference_on_cpu
from tensorsmith.core.metrics import Budget
from tensorsmith.runtime import load
from tensorsmith.runtime.manifest import VariantRecord
from tests.compiler.test_decoder_quantization import TINYLM, calibration_text
from tests.conftest import run_cli


def _record(name: str, path: str | None = None) -> VariantRecord:
    path = path or f"variants/{name}.onnx"
    return VariantRecord(name=name, path=path, sha256="0" * 64, precisions=[name])


def _plan(levels: list[str], met: bool, achieved: float) -> PrecisionPlan:
    layers = [
        LayerChoice(name=f"m{i}", module=f"m{i}", op="MatMul", flops=1, precision=level, reason="search")
        for i, level in enumerate(levels)
    ]
    recipe = RecipePlan(
        precision="int4", float_regions="fp32", met=met, achieved=achieved, quantized_flops_fraction=0.0,
        evaluations=1, embeddings="float", layers=layers, targets=["cpu"],
    )  # fmt: skip
    return PrecisionPlan(precision="auto", budget="cosine>=0.999", recipes={"cpu-int4": recipe})


def test_the_reference_runs_where_nothing_is_quantized_or_the_budget_is_missed() -> None:
    reference, cpu = _record("fp32", "model.onnx"), _record("cpu-int4")
    budget = Budget.parse("cosine>=0.999")
    floats = _plan(["fp32", "fp32"], True, 1.0)
    nothing = cpu_float_instead(cpu, reference, floats, budget, 1000, 1000)
    assert nothing is not None and nothing.variant == "fp32" and "quantized no layer and no table" in nothing.reason
    assert cpu_float_instead(cpu, reference, floats, None, 1000, 1000) is not None  # no budget: the same answer
    # every layer float but smaller than the reference (a vocabulary table in int8): the variant runs
    assert cpu_float_instead(cpu, reference, floats, budget, 850, 1000) is None
    missed = cpu_float_instead(cpu, reference, _plan(["int8-weight", "fp32"], False, 0.998), budget, 800, 1000)
    assert missed is not None and "missed the budget cosine>=0.999 (0.998), which fp32 meets" in missed.reason
    # met with a quantized layer: the variant runs; a budget no reference meets: the unmet variant stays, exit 3
    assert cpu_float_instead(cpu, reference, _plan(["int4", "fp32"], True, 0.9995), budget, 300, 1000) is None
    unreachable = Budget.parse("cosine>=1.5")
    assert cpu_float_instead(cpu, reference, _plan(["int4", "fp32"], False, 0.9), unreachable, 300, 1000) is None
    assert not Budget.parse("sqnr-db>=30").met_by_the_reference  # no lossless value: never assumed
    # a variant that is no recipe's own (the cpu's dynamic-quantization one, built within the budget)
    assert cpu_float_instead(_record("cpu-int8-dynamic"), reference, floats, budget, 300, 1000) is None


def test_the_stage_moves_the_cpu_and_leaves_the_variant_out(tmp_path: Path) -> None:
    (tmp_path / "variants").mkdir()
    for path, size in (("model.onnx", 1000), ("variants/cpu-int4.onnx", 800), ("variants/int4.onnx", 300)):
        (tmp_path / path).write_bytes(bytes(size))
    reference, cpu, gpu = _record("fp32", "model.onnx"), _record("cpu-int4"), _record("int4")
    unmet = {"cpu-int4": "cosine>=0.999 not met (0.998)", "int4": "cosine>=0.999 not met (0.99)"}
    variants = Variants([reference, cpu, gpu], {"cpu": cpu, "sm_86": gpu}, [], unmet)
    plan = _plan(["int8-weight", "fp32"], False, 0.998)
    moved, written = reference_on_cpu(variants, plan, Budget.parse("cosine>=0.999"), tmp_path)
    assert moved.by_target["cpu"].name == "fp32" and moved.by_target["sm_86"].name == "int4"
    assert {record.name: record.shipped for record in moved.records} == {"fp32": True, "cpu-int4": False, "int4": True}
    assert not (tmp_path / "variants/cpu-int4.onnx").exists() and (tmp_path / "variants/int4.onnx").exists()
    assert moved.unmet == {"int4": unmet["int4"]} and "missed the budget" in moved.notes["cpu"]
    instead = written.recipes["cpu-int4"].float_instead
    assert instead is not None and instead.variant == "fp32"


@pytest.mark.slow
def test_a_budget_no_quantized_layer_holds_compiles_to_the_reference(tmp_path: Path) -> None:
    text = calibration_text(tmp_path / "calibration.txt")
    out = tmp_path / "out"
    result = run_cli(
        "compile", TINYLM / "checkpoint", "-o", out, "--target", "cpu", "--precision", "auto",
        "--budget", "next-token-agreement>=1", "--calibration", text, "--calibration-samples", "32",
        "--eval-data", TINYLM / "heldout.txt", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    compiled = json.loads(result.stdout)
    assert compiled["ok"] and not compiled["unmet_budgets"]
    (cpu,) = [target for target in compiled["targets"] if target["name"] == "cpu"]
    assert cpu["variant"] == "fp32" and "cpu-int4" in cpu["reason"]
    variants = {variant["name"]: variant for variant in compiled["variants"]}
    assert not variants["cpu-int4"]["shipped"] and not (out / variants["cpu-int4"]["path"]).exists()
    recipe = json.loads((out / "precision.json").read_text())["recipes"]["cpu-int4"]
    assert recipe["float_instead"]["variant"] == "fp32"
    report = json.loads((out / "report.json").read_text())
    assert recipe["float_instead"]["reason"].startswith("cpu-int4 missed the budget next-token-agreement>=1")
    # one fact, one number: precision.json's figure is the one manifest.json records (the shipped kernels')
    assert recipe["achieved"] == variants["cpu-int4"]["accuracy"]["next-token-agreement"]
    assert report["budget_outcomes"]["cpu-int4"]["instead"] == f"the cpu runs fp32: {recipe['float_instead']['reason']}"
    assert "Instead of cpu-int4, the cpu runs fp32" in (out / "report.html").read_text()
    generated = load(out, backend="onnxruntime").generate(np.array([[1, 5, 9]]), max_new_tokens=4)
    assert generated.shape == (1, 7)
