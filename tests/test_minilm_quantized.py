"""The real MiniLM, calibrated on 128 real sentences (seq 64): int8 and fp8 variants that ONNX Runtime runs and
TensorRT for RTX builds for every architecture that supports them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from tensorsmith.calibration import CalibrationData, calibrate
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import profile_for
from tensorsmith.core.metrics import mean_cosine
from tensorsmith.core.sessions import run_onnx
from tensorsmith.passes import run_passes
from tensorsmith.passes.quantize import InsertQDQ
from tensorsmith.runtime import load
from tensorsmith.runtime.manifest import read_manifest
from tensorsmith.samples import prepare
from tests.conftest import MINILM_INT8_TARGETS, run_cli_json
from tests.report_rendering import check_report_renders

MINILM = prepare.SAMPLES / "minilm"
INT8_TARGETS = MINILM_INT8_TARGETS


@pytest.fixture
def int8_artifact(minilm_int8_artifact: Path) -> Path:
    return minilm_int8_artifact  # compiled once per session (tests/conftest.py)


def held_out() -> dict[str, np.ndarray]:
    with np.load(MINILM / "evaluation.npz") as archive:
        return {name: archive[name] for name in archive.files}


@pytest.mark.slow
def test_int8_variant_runs_and_builds_for_every_int8_architecture(int8_artifact: Path) -> None:
    manifest = read_manifest(int8_artifact)
    for name in ("int8", "cpu-int8"):  # fp16 around the int8 layers on GPUs, fp32 on the cpu
        variant = manifest.variant(name)
        assert variant.accuracy["cosine"] > 0.9  # every MatMul in int8: --precision auto chooses per layer
        assert variant.evaluated_on.endswith("evaluation.npz")
    calibration = (int8_artifact / "calibration.json").read_text()
    assert '"samples": 128' in calibration
    built = {t.name: t for t in manifest.targets if t.status == "built"}
    assert sorted(built) == sorted(INT8_TARGETS)
    assert all(target.variant == "int8" for target in built.values())
    with load(int8_artifact) as model:
        outputs = model.run(held_out())
    assert outputs["sentence_embedding"].shape == (64, 384)


@pytest.mark.slow
def test_fp8_variant_runs_and_builds_for_ada_and_blackwell(int8_artifact: Path, tmp_path: Path) -> None:
    manifest = read_manifest(int8_artifact)
    model = onnx.load(str(int8_artifact / "model.onnx"))
    specs = [record.spec() for record in manifest.inputs]
    table = calibrate(model, CalibrationData(MINILM / "calibration.npz", specs))
    graph = gs.import_onnx(model)
    run_passes(graph, [InsertQDQ("fp8", table.fp8_scales())])
    path = tmp_path / "fp8.onnx"
    onnx.save(gs.export_onnx(graph), str(path))

    feeds = held_out()
    reference = run_onnx(int8_artifact / "model.onnx", feeds)[1]
    assert mean_cosine(reference, run_onnx(path, feeds)[1]) > 0.99
    config = CompileConfig.from_toml(MINILM / "tensorsmith.toml")
    for target in ("sm_89", "sm_120"):
        assert len(build_engine(path, target, profile_for(manifest.inputs, config.dims)).plan) > 0


@pytest.mark.slow
def test_minilm_scales_do_not_depend_on_batch_size_or_order(int8_artifact: Path) -> None:
    manifest = read_manifest(int8_artifact)
    model = onnx.load(str(int8_artifact / "model.onnx"))
    specs = [record.spec() for record in manifest.inputs]
    with np.load(MINILM / "calibration.npz") as archive:
        samples = {name: archive[name][:32] for name in archive.files}

    def scales(feeds: dict[str, np.ndarray], batch_size: int) -> dict[str, float]:
        table = calibrate(model, CalibrationData([feeds], specs, batch_size=batch_size))
        return {name: tensor.int8_scale for name, tensor in table.tensors.items()}

    reference = scales(samples, 8)
    assert scales(samples, 1) == reference
    assert scales(samples, 32) == reference
    assert scales({name: array[::-1].copy() for name, array in samples.items()}, 8) == reference


@pytest.mark.slow
def test_auto_precision_meets_the_budget_on_held_out_sentences(tmp_path: Path) -> None:
    """`--precision auto --budget 'cosine>=0.995'` with int8 (cpu, sm_86) and fp8 (sm_89) recipes."""
    import json

    out = tmp_path / "auto"
    targets = [arg for target in ("cpu", "sm_86", "sm_89") for arg in ("--target", target)]
    compiled = run_cli_json(
        "compile", MINILM / "tensorsmith.toml", "-o", out, "--precision", "auto", "--budget", "cosine>=0.995",
        "--calibration", MINILM / "calibration.npz", "--eval-data", MINILM / "evaluation.npz", *targets,
    )  # fmt: skip
    assert compiled["ok"] and not compiled["unmet_budgets"]
    plan = json.loads((out / "precision.json").read_text())
    for name in ("cpu-int8", "int8", "fp8"):
        recipe = plan["recipes"][name]
        assert recipe["met"] and recipe["achieved"] >= 0.995
        assert all(layer["module"].startswith("bert.encoder.layer.") for layer in recipe["layers"])
    assert plan["recipes"]["fp8"]["quantized_flops_fraction"] >= 0.7
    # The dynamic-int8 graph for the cpu: layer 0's GELU unit 856 (24.7 on [CLS], median unit 1.3) and a few
    # others go to a float branch; smoothing after the 12 LayerNorms that feed weight MatMuls.
    preparation = plan["recipes"]["cpu-int8"]["cpu"]["dynamic_preparation"]
    assert 856 in preparation["split_outlier_neurons"]["units"]["node_MatMul_94"]
    assert preparation["smooth_activations"]["activations_smoothed"] == 12
    variants = {variant["name"]: variant for variant in compiled["variants"]}
    for variant in variants.values():
        if variant["name"] != "fp32":
            assert variant["accuracy"]["cosine"] >= 0.995, variant["name"]
    built = {target["name"]: target["variant"] for target in compiled["targets"] if target["status"] == "built"}
    assert built == {"sm_86": "int8", "sm_89": "fp8"}

    report = json.loads((out / "report.json").read_text())
    assert set(report["sensitivity"]) == {"int8", "fp8"} and len(report["sensitivity"]["int8"]) == 48
    assert len(report["histograms"]) == 6 and all(h["threshold"] <= h["amax"] for h in report["histograms"])
    assert {row["target"]: row["status"] for row in report["engines"]} == {
        "cpu": "not-needed", "sm_86": "built", "sm_89": "built"
    }  # fmt: skip
    assert report["cpu"]["variant"] == {t["name"]: t["variant"] for t in compiled["targets"]}["cpu"]
    assert "<h2>CPU recipe</h2>" in (out / "report.html").read_text()
    check_report_renders(out, tmp_path, quantized=True)


@pytest.mark.slow
def test_triton_repository_for_minilm_parses_with_tritons_schema(int8_artifact: Path, tmp_path: Path) -> None:
    """MiniLM's cpu variant and its SM89 engine as one Triton model repository."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    repository = tmp_path / "models"
    for target in ("cpu", "sm_89"):
        run_cli_json("export-triton", int8_artifact, "--target", target, "-o", repository, "--name", f"minilm_{target}")
    configs = {
        path.name: text_format.Parse((path / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        for path in repository.iterdir()
    }
    assert configs["minilm_cpu"].platform == "onnxruntime_onnx"
    assert configs["minilm_sm_89"].platform == "tensorrt_plan"
    for config in configs.values():
        assert config.max_batch_size == 64
        assert [(t.name, list(t.dims)) for t in config.input] == [("input_ids", [-1]), ("attention_mask", [-1])]
        assert [(t.name, list(t.dims)) for t in config.output] == [("token_embeddings", [-1, 384]),
                                                                   ("sentence_embedding", [384])]  # fmt: skip
        assert list(config.dynamic_batching.preferred_batch_size) == [8, 64]
    assert (repository / "minilm_sm_89" / "1" / "model.plan").stat().st_size > 1_000_000
    assert (repository / "minilm_cpu" / "1" / "model.onnx").stat().st_size > 1_000_000
