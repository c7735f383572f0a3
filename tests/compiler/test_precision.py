"""--precision auto: sensitivity, the budget search, overrides, policy, precision.json and exit code 3."""

import json
from pathlib import Path

import numpy as np
import pytest

from tensorsmith.compiler.variants.cpu_backend import MIN_GAIN, fastest_pair
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.metrics import Budget
from tensorsmith.runtime import load
from tensorsmith.runtime.device import Device
from tensorsmith.samples import prepare
from tests.conftest import run_cli

TINY = prepare.SAMPLES / "tiny_bert"


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real sentences (MiniLM's tokens, folded into tiny_bert's 1000-word vocabulary)."""
    prepare.prepare("minilm")
    prepare.prepare("tiny_bert")
    with np.load(prepare.SAMPLES / "minilm" / "calibration.npz") as archive:
        arrays = {name: archive[name][:48, :32] for name in archive.files}
    arrays["input_ids"] = arrays["input_ids"] % 1000
    path = tmp_path_factory.mktemp("tiny") / "calibration.npz"
    np.savez(path, **arrays)
    return path


def compile_auto(out: Path, calibration: Path, budget: str, *extra: str) -> tuple[int, dict, str]:
    result = run_cli(
        "compile", TINY / "tensorsmith.toml", "-o", out, "--precision", "auto", "--budget", budget,
        "--calibration", calibration, "--target", "cpu", "--target", "sm_75", "--target", "sm_89", *extra, "--json",
    )  # fmt: skip
    return result.exit_code, json.loads(result.stdout), result.stderr


@pytest.mark.slow
def test_auto_meets_the_budget_per_recipe_and_explains_each_layer(calibration: Path, tmp_path: Path) -> None:
    code, compiled, _ = compile_auto(tmp_path / "out", calibration, "cosine>=0.999")
    assert code == 0 and compiled["ok"]
    variants = {v["name"]: v for v in compiled["variants"]}
    assert {"cpu-int8", "int8", "fp8"} <= set(variants)
    targets = {t["name"]: t for t in compiled["targets"]}
    assert targets["sm_89"]["variant"] == "fp8" and targets["sm_75"]["variant"] == "int8"
    assert targets["sm_89"]["status"] == targets["sm_75"]["status"] == "built"  # Turing: int8 + fp16 regions
    plan = json.loads((tmp_path / "out" / "precision.json").read_text())
    assert plan["budget"] == "cosine>=0.999"
    assert "held out" in plan["evaluated_on"]
    for name in ("cpu-int8", "int8", "fp8"):
        recipe = plan["recipes"][name]
        assert recipe["met"] and recipe["achieved"] >= 0.999
        assert variants[name]["accuracy"]["cosine"] >= 0.999
        layers = recipe["layers"]
        assert len(layers) == 16  # 2 layers × (Q, K, V, Q·Kᵀ, P·V, output, FFN up, FFN down)
        assert all(layer["sensitivity"] is not None for layer in layers)
        assert all(layer["reason"].startswith("search") for layer in layers)  # a float one says why
        assert any(layer["module"].startswith("layers.0.attention") for layer in layers)
        quantized = [layer for layer in layers if layer["precision"] == recipe["precision"]]
        assert len(quantized) > 0 and recipe["evaluations"] <= 16 + 6 + 4  # sensitivity + bisection + retries
        assert recipe["quantized_flops_fraction"] > 0
    # cpu runs whichever of the static Q/DQ and the dynamic-quantization variant runs faster, on whichever cpu
    # backend runs it faster (OpenVINO by MIN_GAIN over ONNX Runtime's fastest).
    cpu = plan["recipes"]["cpu-int8"]["cpu"]
    assert targets["cpu"]["variant"] == cpu["variant"]
    if cpu["latency_ms_batch8"]:
        pairs = cpu["latency_ms_by_backend"]
        assert {name: times["onnxruntime"] for name, times in pairs.items()} == cpu["latency_ms_batch8"]
        assert (cpu["variant"], variants[cpu["variant"]]["backend"]) == fastest_pair(pairs)
        assert variants[cpu["variant"]]["backend_latency_ms"] == pairs[cpu["variant"]]
        assert variants[cpu["variant"]]["accuracy"]["cosine"] >= 0.999
        assert cpu["dynamic_preparation"]["split_outlier_neurons"]["mlps_split"] >= 0
    # ... with the ONNX Runtime optimizers measured slower on it switched off, in the manifest for the runtime.
    session = cpu["onnxruntime_session"]
    disabled = session["disabled_optimizers"]
    assert variants[cpu["variant"]]["onnxruntime_disabled_optimizers"] == disabled
    by_setting = session["latency_ms_batch8"]
    if disabled:
        assert by_setting[f"without {', '.join(disabled)}"] < by_setting["defaults"] * (1 - MIN_GAIN)
    # The runtime runs the backend the compile measured faster (OpenVINO wins on some machines); forced onto ONNX
    # Runtime, it applies the recorded session settings.
    chosen = variants[cpu["variant"]]["backend"]
    cpu_only = Device(None, reason="no CUDA device")
    with load(tmp_path / "out", device=cpu_only) as model:
        assert model.backend.startswith(chosen)
    with load(tmp_path / "out", device=cpu_only, backend="onnxruntime") as model:
        assert model.backend.startswith("onnxruntime") and model._backend.disabled_optimizers == disabled  # type: ignore[attr-defined]


def test_overrides_pin_layers_before_the_search(calibration: Path, tmp_path: Path) -> None:
    config = (
        (TINY / "tensorsmith.toml").read_text().replace('"weights.safetensors"', f'"{TINY / "weights.safetensors"}"')
    )
    config += '\n[[overrides]]\nmatch = "layers.1.*"\nprecision = "fp32"\n'
    toml = tmp_path / "tensorsmith.toml"
    toml.write_text(config)
    result = run_cli(
        "compile", toml, "-o", tmp_path / "out", "--precision", "auto", "--budget", "cosine>=0.99",
        "--calibration", calibration, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    layers = json.loads((tmp_path / "out" / "precision.json").read_text())["recipes"]["cpu-int8"]["layers"]
    pinned = [layer for layer in layers if layer["module"].startswith("layers.1")]
    assert pinned and all(layer["precision"] == "fp32" and "override" in layer["reason"] for layer in pinned)


def test_an_unmeetable_budget_exits_3_with_the_plan_written(calibration: Path, tmp_path: Path) -> None:
    # Quantizing nothing always meets a reachable budget on these targets; this one no plan can reach.
    code, compiled, stderr = compile_auto(tmp_path / "out", calibration, "cosine>=1.5")
    assert code == 3
    assert compiled["ok"] is False and compiled["unmet_budgets"]
    assert "accuracy budget not met" in stderr and "precision.json" in stderr
    assert (tmp_path / "out" / "precision.json").is_file()
    assert (tmp_path / "out" / "manifest.json").is_file()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cosine>0.9", "is not METRIC>=VALUE"),
        ("accuracy>=0.9", "unknown metric 'accuracy'"),
        ("cosine<=0.9", "higher cosine is better"),
        ("max-abs>=0.1", "lower max-abs is better"),
    ],
)
def test_malformed_budgets_are_config_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Budget.parse(text)


def first_output_agreement(reference: list, outputs: list) -> float:
    """A user metric: the fraction of elements whose sign matches."""
    return float(np.mean(np.sign(reference[0]) == np.sign(outputs[0])))


def test_metrics_and_a_user_function() -> None:
    reference = [np.array([[1.0, 0.0], [0.0, 2.0]])]
    assert Budget.parse("cosine>=0.9").measure(reference, reference) == pytest.approx(1.0)
    assert Budget.parse("max-abs<=0.1").measure(reference, [reference[0] + 0.05]) == pytest.approx(0.05)
    assert Budget.parse("sqnr-db>=10").measure(reference, [reference[0] * 1.1]) == pytest.approx(20.0)
    assert Budget.parse("min-cosine>=0.5").measure(reference, [np.array([[1.0, 0.0], [2.0, 0.0]])]) == 0.0
    user = Budget.parse("tests.compiler.test_precision:first_output_agreement>=0.5")
    assert user.measure(reference, [-reference[0]]) == 0.5  # the zeros agree
    assert user.met(0.5) and not user.met(0.4)


def test_language_model_budgets_measure_on_their_tokens() -> None:
    tokens = np.array([[0, 1, 2, 1], [2, 2, 0, 1]])
    confident = np.log(np.full((2, 4, 3), 0.05))
    np.put_along_axis(confident[:, :-1], tokens[:, 1:, None], np.log(0.9), -1)  # right about every next token
    unsure = np.zeros((2, 4, 3))  # uniform
    ratio = Budget.parse("perplexity-ratio<=1.03").on_tokens(tokens)
    assert ratio.is_language and not ratio.met(ratio.measure([confident], [unsure]))
    assert ratio.measure([confident], [unsure]) == pytest.approx(3 * 0.9)  # exp(log 3 - (-log 0.9))
    assert ratio.measure([confident], [confident]) == pytest.approx(1.0)
    agreement = Budget.parse("next-token-agreement>=0.9").on_tokens(tokens)
    assert agreement.measure([confident], [confident[:1]]) == 1.0  # a search's first rows
    with pytest.raises(ConfigError, match="higher next-token-agreement is better"):
        Budget.parse("next-token-agreement<=0.9")
    with pytest.raises(ConfigError, match="language-model metric"):
        Budget.parse("perplexity<=30").measure([confident], [unsure])  # no tokens: not a decoder's text
