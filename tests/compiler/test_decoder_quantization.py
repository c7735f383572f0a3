"""Quantized decoders: calibration feeds from real text cover prefill and decode steps, language-model budgets
(perplexity-ratio) choose the layers, and the variants generate and build engines with both profiles. On the
tinylm sample (a Llama trained on CPython's docs) with calibration text it never saw in evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tensorsmith.calibration.data import CalibrationData
from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.variants.text_data import (
    DECODE_TIMING_ROWS,
    DecoderFeeds,
    decode_step,
    decode_timing_step,
    prefill_feeds,
    prefills_only,
    token_windows,
)
from tensorsmith.core import sessions
from tensorsmith.core.sessions import run_onnx
from tensorsmith.runtime import load
from tensorsmith.runtime.manifest import TensorRecord, read_manifest
from tests.conftest import max_relative_error

TINYLM = Path(__file__).parents[2] / "samples" / "tinylm"


def calibration_text(path: Path) -> Path:
    """Text from the standard library's docs, not the held-out split the sample evaluates on."""
    import pydoc_data.topics

    path.write_text("\n".join(list(pydoc_data.topics.topics.values())[:60]), encoding="utf-8")
    return path


@pytest.fixture
def fp32_tinylm(tinylm_dynamic_cache_artifact: Path) -> Path:
    return tinylm_dynamic_cache_artifact  # the graph calibration runs (dynamic cache), compiled once per session


def test_a_bounded_read_tokenizes_a_prefix_to_the_same_ids(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    text = calibration_text(tmp_path / "c.txt")
    config = CompileConfig.create({"source": str(TINYLM / "checkpoint")})
    everything = Tokenizer.from_file(str(TINYLM / "checkpoint" / "tokenizer.json")).encode(text.read_text()).ids
    windows = token_windows(config, text, 128, 3)
    assert windows.shape == (3, 128) and windows.reshape(-1).tolist() == everything[: 3 * 128]
    assert len(token_windows(config, text, 128, None)) == len(everything) // 128


def test_decode_calibration_feeds_continue_the_prefill(
    fp32_tinylm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step over the sliced fp32 cache gives the prefill's logits at that position: the feeds are what
    generation runs, not made-up caches."""
    manifest = read_manifest(fp32_tinylm)
    config = CompileConfig.create({"source": str(TINYLM / "checkpoint")})
    windows = token_windows(config, calibration_text(tmp_path / "c.txt"), 32, 3)
    model = fp32_tinylm / "model.onnx"
    feeds = list(DecoderFeeds(model, windows, manifest.inputs, batch_size=2))
    assert len(feeds) == 2 * 4  # two batches: a prefill and three decode steps each
    prefill_logits = run_onnx(model, feeds[0])[0]
    for step in feeds[1:4]:
        past = step["past_key_values.0.key"].shape[2]
        assert step["input_ids"].shape == (2, 1) and step["attention_mask"].shape == (2, past + 1)
        logits = run_onnx(model, step)[0]
        assert max_relative_error(prefill_logits[:, past : past + 1], logits) < 1e-4
    specs = [record.spec() for record in manifest.inputs]
    assert CalibrationData(feeds, specs).count() == 3 * 4  # 3 windows, a prefill and 3 steps each
    # what AWQ's statistics pass reads: the decode steps' rows are the prefill's (above), so only the prefills
    prefills = prefills_only(CalibrationData(DecoderFeeds(model, windows, manifest.inputs, 2), specs, batch_size=2))
    with monkeypatch.context() as patched:  # and they run nothing themselves: the observer runs each prefill once
        patched.setattr(sessions, "open_session", _never_run)
        patched.setattr(sessions, "run_remembered", _never_run)
        assert [batch["input_ids"].shape for batch in prefills.batches()] == [(2, 32), (1, 32)]


def test_the_decode_step_timed_is_made_from_the_evaluations_prefill(fp32_tinylm: Path, tmp_path: Path) -> None:
    """The cpu recipe's timing step is the decode step calibration makes at half a window (the same feeds, to the
    byte), from the reference's outputs on the evaluation prefill: no second fp32 prefill runs for it."""
    manifest = read_manifest(fp32_tinylm)
    config = CompileConfig.create({"source": str(TINYLM / "checkpoint")})
    windows = token_windows(config, calibration_text(tmp_path / "c.txt"), 32, 10)
    model = fp32_tinylm / "model.onnx"
    prefill = prefill_feeds(windows, manifest.inputs)
    step = decode_timing_step(windows, manifest.inputs, manifest.outputs, run_onnx(model, prefill))
    made = list(DecoderFeeds(model, windows[:DECODE_TIMING_ROWS], manifest.inputs, batch_size=DECODE_TIMING_ROWS))
    assert step.keys() == made[2].keys() and step["past_key_values.0.key"].shape[:3] == (DECODE_TIMING_ROWS, 2, 16)
    for name, values in made[2].items():  # the prefill, then the steps at a quarter and at half of the window
        np.testing.assert_array_equal(step[name], values, err_msg=name)


def test_a_decode_step_keeps_a_hybrid_s_fixed_states_whole() -> None:
    """Keys and values are cut to the tokens before the step; a linear-attention layer's states (fixed shapes, as
    Qwen3.5's: a recurrent state whose third axis is its key size) are taken as the prefill left them."""
    inputs = [
        TensorRecord(name="input_ids", dtype="int64", shape=["batch", "sequence"]),
        TensorRecord(name="past_key_values.1.key", dtype="float32", shape=["batch", 2, "past", 16]),
        TensorRecord(name="past_key_values.0.recurrent", dtype="float32", shape=["batch", 4, 128, 8]),
        TensorRecord(name="past_key_values.0.conv", dtype="float32", shape=["batch", 96, 3]),
    ]
    presents = {
        "present.1.key": np.zeros((3, 2, 32, 16), np.float32),
        "present.0.recurrent": np.ones((3, 4, 128, 8), np.float32),
        "present.0.conv": np.ones((3, 96, 3), np.float32),
    }
    step = decode_step(np.zeros((3, 32), np.int64), 8, inputs, presents)
    assert step["past_key_values.1.key"].shape == (3, 2, 8, 16)
    assert step["past_key_values.0.recurrent"].shape == (3, 4, 128, 8)
    assert step["past_key_values.0.conv"].shape == (3, 96, 3)
    assert list(step) == [record.name for record in inputs]


def _never_run(*args: object) -> None:
    raise AssertionError("prefill feeds ran a session")


@pytest.mark.slow
def test_int8_and_fp8_calibrate_on_prefill_and_decode_and_the_variants_generate(tmp_path: Path) -> None:
    """--precision int8 / fp8 for a decoder (every layer the policy allows, calibrated activations), measured as a
    language model; a decoder's `auto` chooses weight precisions instead (tests/compiler/test_int4.py)."""
    text = calibration_text(tmp_path / "calibration.txt")
    common = {
        "source": str(TINYLM / "checkpoint"),
        "calibration": str(text),
        "calibration_samples": 32,
        "evaluation": str(TINYLM / "heldout.txt"),
        "generation": {"max_sequence_length": 256, "max_batch": 4},
    }
    int8 = compile(CompileConfig.create({**common, "targets": ["cpu", "sm_86"], "precision": "int8"}),
                   tmp_path / "int8").manifest  # fmt: skip
    fp8 = compile(CompileConfig.create({**common, "targets": ["sm_89"], "precision": "fp8"}), tmp_path / "fp8").manifest
    by_name = {variant.name: variant for manifest in (int8, fp8) for variant in manifest.variants}
    assert by_name["fp32"].accuracy["perplexity-ratio"] == 1.0
    for name in ("int8", "cpu-int8", "fp8"):
        accuracy = by_name[name].accuracy
        assert 0.95 < accuracy["perplexity-ratio"] < 1.3 and 0 < accuracy["next-token-agreement"] < 1, name
        assert "heldout.txt" in by_name[name].evaluated_on
    # calibration ran prefill and decode steps: 32 windows, 4 feeds each
    table = json.loads((tmp_path / "int8" / "calibration.json").read_text())
    assert table["samples"] == 32 * 4
    for target in [*int8.targets[1:], *fp8.targets]:
        assert target.status == "built" and target.variant in ("int8", "fp8"), target.reason
        assert target.engine is not None and target.engine.profile_names == ["prefill", "decode"]

    prompt = np.array([[1, *token_windows(CompileConfig.create(common), TINYLM / "heldout.txt", 16, 1)[0]]], np.int64)
    quantized = load(tmp_path / "int8", backend="onnxruntime").generate(prompt, max_new_tokens=16)
    assert quantized.shape == (1, 17 + 16) and (quantized[:, :17] == prompt).all()


def test_every_weight_level_in_one_variant_runs_and_builds_for_ada(fp32_tinylm: Path, tmp_path: Path) -> None:
    """int4, int8 weight-only, int8 and fp8 W8A8 (activations quantized per tensor) and float layers in one
    variant, as a decoder's auto may mix them: ONNX Runtime runs it close to fp32, and tensorrt-rtx builds it for
    sm_89 with both profiles."""
    import onnx

    from tensorsmith.calibration import Observer
    from tensorsmith.compiler.config import DimRange
    from tensorsmith.compiler.engines.builder import build_engine
    from tensorsmith.compiler.engines.profiles import decoder_profiles
    from tensorsmith.compiler.targets import Recipe
    from tensorsmith.compiler.variants.int4 import build_int4_variant, plan_int4
    from tensorsmith.compiler.variants.measure import Evaluation
    from tensorsmith.compiler.variants.rewrite import rewritten
    from tensorsmith.compiler.variants.text_data import prefill_feeds
    from tensorsmith.core.precisions import FP16, INT4
    from tensorsmith.core.progress import LogReporter
    from tensorsmith.passes.int4 import GemmAsMatMul

    manifest = read_manifest(fp32_tinylm)
    model, _ = rewritten(onnx.load(fp32_tinylm / "model.onnx"), [GemmAsMatMul()])
    plan = plan_int4(model, "rtn", 128, None, LogReporter())
    levels = ("int4", "int8-weight", "int8", "fp8", "fp16")
    assignment = {name: levels[index % len(levels)] for index, name in enumerate(plan.weights)}
    config = CompileConfig.create({"source": str(TINYLM / "checkpoint")})
    feeds = prefill_feeds(token_windows(config, calibration_text(tmp_path / "c.txt"), 32, 4), manifest.inputs)
    activations = sorted({plan.layers[name].activation for name in plan.weights})
    amax = {name: float(np.abs(value).max()) for name, value in Observer(model, activations).run(feeds).items()}
    scales = {"int8": {name: value / 127 for name, value in amax.items()},
              "fp8": {name: value / 448 for name, value in amax.items()}}  # fmt: skip
    evaluation = Evaluation(feeds, run_onnx(fp32_tinylm / "model.onnx", feeds), None, "four windows")
    record, _ = build_int4_variant(model, Recipe(INT4, FP16), plan, evaluation, tmp_path, assignment,
                                   scales=scales)  # fmt: skip
    assert record.precisions == ["int8-weight", "int8", "int4", "fp8", "fp16"]
    assert record.accuracy["cosine"] > 0.99, record.accuracy
    variant = onnx.load(tmp_path / record.path)
    constants = {tensor.name: tensor.data_type for tensor in variant.graph.initializer}
    zero_points = {constants[node.input[2]] for node in variant.graph.node if node.op_type == "QuantizeLinear"}
    assert zero_points == {onnx.TensorProto.INT8, onnx.TensorProto.FLOAT8E4M3FN}
    assert any(attribute.name == "block_size" for node in variant.graph.node for attribute in node.attribute)
    dims = {name: DimRange.model_validate(limits) for name, limits in manifest.dims.items()}
    profiles = decoder_profiles(manifest.inputs, dims, "sm_89")
    built = build_engine(tmp_path / record.path, "sm_89", profiles)
    assert built.profile_names == ["prefill", "decode"] and len(built.plan) > 0


def test_engines_are_built_from_last_position_logits(fp32_tinylm: Path, tmp_path: Path) -> None:
    """The engine graph's prefill projects the last position only (logits [batch, 1, vocab], what generation
    reads); the variant keeps every position for perplexity. Same tokens from both graphs; TensorRT's network
    output has sequence length 1."""
    import onnx
    import onnx_graphsurgeon as gs
    import tensorrt_rtx as trt

    from tensorsmith.compiler.engines.engine_graph import engine_graph
    from tensorsmith.compiler.variants.text_data import prefill_feeds
    from tensorsmith.runtime.loader import Model
    from tensorsmith.runtime.onnxruntime_backend import OnnxRuntimeBackend

    manifest = read_manifest(fp32_tinylm)
    tokens = np.random.default_rng(0).integers(3, 200, (2, 17)).astype(np.int64)
    feeds = prefill_feeds(tokens, manifest.inputs)
    with engine_graph(fp32_tinylm, manifest.variants[0], decoder=True) as (sliced, _):
        last = onnx.load(sliced)
        (full_logits, *_), (last_logits, *_) = run_onnx(fp32_tinylm / "model.onnx", feeds), run_onnx(last, feeds)
        assert last_logits.shape == (2, 1, full_logits.shape[-1])
        np.testing.assert_allclose(last_logits[:, 0], full_logits[:, -1], rtol=1e-5, atol=1e-5)
        assert any(node.op == "Gather" and node.name.endswith("LastPosition") for node in gs.import_onnx(last).nodes)
        specs = ([r.spec() for r in manifest.inputs], [r.spec() for r in manifest.outputs])
        prompt = np.array([[1, 5, 9, 14]], np.int64)
        with Model(fp32_tinylm, manifest, OnnxRuntimeBackend(sliced, *specs), None) as model:
            expected = load(fp32_tinylm, backend="onnxruntime").generate(prompt, max_new_tokens=6)
            np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=6), expected)
        logger = trt.Logger(trt.Logger.ERROR)
        network = trt.Builder(logger).create_network(0)
        assert trt.OnnxParser(network, logger).parse_from_file(str(sliced))
        logits = next(
            network.get_output(i) for i in range(network.num_outputs) if network.get_output(i).name == "logits"
        )
        assert tuple(logits.shape)[1] == 1
