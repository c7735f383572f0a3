"""The OpenVINO backend against ONNX Runtime: a tiny graph with a KV cache that starts empty, the real MiniLM
(fp32 and its int8 Q/DQ cpu variant) and greedy generation on the tinylm decoder."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorsmith.runtime import RuntimeLoadError, TensorSpec, load
from tensorsmith.runtime.loader import Model
from tensorsmith.runtime.manifest import Manifest, read_manifest
from tensorsmith.runtime.openvino_backend import OpenVinoBackend, openvino_unavailable
from tensorsmith.samples import prepare
from tests.conftest import small_mlp_onnx

needs_openvino = pytest.mark.skipif(openvino_unavailable() is not None, reason=str(openvino_unavailable()))
MINILM = prepare.SAMPLES / "minilm"
TINYLM = prepare.SAMPLES / "tinylm"


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def specs(manifest: Manifest) -> tuple[list[TensorSpec], list[TensorSpec]]:
    return [record.spec() for record in manifest.inputs], [record.spec() for record in manifest.outputs]


def mean_cosine(reference: np.ndarray, actual: np.ndarray) -> float:
    reference, actual = reference.reshape(len(reference), -1), actual.reshape(len(actual), -1)
    products = np.sum(reference * actual, axis=1)
    return float(np.mean(products / (np.linalg.norm(reference, axis=1) * np.linalg.norm(actual, axis=1))))


def cached_attention_onnx(path: Path) -> Path:
    """One attention step over a KV cache: present = concat(past, key) on the sequence axis, y = softmax(query @
    presentᵀ) @ present after a projection; batch, past and new lengths dynamic."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["key"]),
        helper.make_node("Concat", ["past_key_values.0.key", "key"], ["present.0.key"], axis=2),
        helper.make_node("Transpose", ["present.0.key"], ["keys_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["x", "keys_t"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["weights"], axis=-1),
        helper.make_node("MatMul", ["weights", "present.0.key"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "cached_attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, "sequence", 4]),
         helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["batch", 2, "past", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, "sequence", 4]),
         helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["batch", 2, "total", 4])],
        initializer=[weight],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


CACHED_INPUTS = [TensorSpec("x", "float32", ("batch", 2, "sequence", 4)),
                 TensorSpec("past_key_values.0.key", "float32", ("batch", 2, "past", 4))]  # fmt: skip
CACHED_OUTPUTS = [TensorSpec("y", "float32", ("batch", 2, "sequence", 4)),
                  TensorSpec("present.0.key", "float32", ("batch", 2, "total", 4))]  # fmt: skip


def test_without_openvino_it_says_so_and_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    assert "openvino is not installed" in str(openvino_unavailable())
    hint = r"openvino is not installed \(hint: pip install 'tensorsmith\[openvino\]'\)"
    with pytest.raises(RuntimeLoadError, match=hint):
        OpenVinoBackend(tmp_path / "model.onnx", [], [])


@needs_openvino
def test_a_torch_mlp_matches_onnxruntime(tmp_path: Path) -> None:
    path = small_mlp_onnx(tmp_path / "mlp.onnx")
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    with OpenVinoBackend(path, [TensorSpec("x", "float32", (2, 8))], [TensorSpec("y", "float32", (2, 4))]) as backend:
        assert backend.name == "openvino:CPU"
        outputs = backend.run({"x": x})
    assert list(outputs) == ["y"]
    np.testing.assert_allclose(outputs["y"], ort_run(path, {"x": x})["y"], rtol=1e-4, atol=1e-6)


@needs_openvino
def test_a_kv_cache_that_starts_empty_matches_onnxruntime_step_by_step(tmp_path: Path) -> None:
    path = cached_attention_onnx(tmp_path / "cached.onnx")
    rng = np.random.default_rng(1)
    past = np.zeros((2, 2, 0, 4), np.float32)  # the prefill's zero-length past
    with OpenVinoBackend(path, CACHED_INPUTS, CACHED_OUTPUTS, threads=1) as backend:
        for length in (5, 1, 1):  # a prefill, then two decode steps feeding each present back
            feeds = {"x": rng.standard_normal((2, 2, length, 4)).astype(np.float32), "past_key_values.0.key": past}
            outputs, expected = backend.run(feeds), ort_run(path, feeds)
            assert list(outputs) == ["y", "present.0.key"]
            for name in expected:
                np.testing.assert_allclose(outputs[name], expected[name], rtol=1e-4, atol=1e-6)
            past = outputs["present.0.key"]
    assert past.shape == (2, 2, 7, 4)


@needs_openvino
def test_attention_without_a_mask_is_right_after_a_one_token_run(tmp_path: Path) -> None:
    """OpenVINO 2026.4's snippets fusion of this pattern gives relative errors of 10-100 at lengths 8 and 64
    after a run of length 1 (SAFE_CONFIG turns it off)."""
    path = cached_attention_onnx(tmp_path / "cached.onnx")
    rng = np.random.default_rng(3)
    with OpenVinoBackend(path, CACHED_INPUTS, CACHED_OUTPUTS) as backend:
        for length in (1, 8, 64, 8):
            feeds = {"x": rng.standard_normal((1, 2, length, 4)).astype(np.float32),
                     "past_key_values.0.key": np.zeros((1, 2, 0, 4), np.float32)}  # fmt: skip
            np.testing.assert_allclose(backend.run(feeds)["y"], ort_run(path, feeds)["y"], rtol=1e-4, atol=1e-5)


@needs_openvino
def test_the_arrays_returned_are_not_overwritten_by_the_next_run(tmp_path: Path) -> None:
    path = cached_attention_onnx(tmp_path / "cached.onnx")
    feeds = {"x": np.ones((1, 2, 3, 4), np.float32), "past_key_values.0.key": np.zeros((1, 2, 0, 4), np.float32)}
    with OpenVinoBackend(path, CACHED_INPUTS, CACHED_OUTPUTS) as backend:
        first = backend.run(feeds)
        kept = {name: array.copy() for name, array in first.items()}
        backend.run({name: array * 2 for name, array in feeds.items()})
    for name, array in kept.items():
        np.testing.assert_array_equal(first[name], array)


@needs_openvino
def test_concurrent_callers_each_get_their_own_results(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    path = cached_attention_onnx(tmp_path / "cached.onnx")
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.standard_normal((1, 2, length, 4)).astype(np.float32),
              "past_key_values.0.key": np.zeros((1, 2, 0, 4), np.float32)} for length in range(1, 17)]  # fmt: skip
    with OpenVinoBackend(path, CACHED_INPUTS, CACHED_OUTPUTS) as backend, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(backend.run, feeds * 4))
    for one, result in zip(feeds * 4, results, strict=True):
        np.testing.assert_allclose(result["y"], ort_run(path, one)["y"], rtol=1e-4, atol=1e-6)


@needs_openvino
def test_a_file_openvino_cannot_read_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x08\x07not a model")
    with pytest.raises(RuntimeLoadError, match=r"OpenVINO could not load .*broken\.onnx") as raised:
        OpenVinoBackend(path, [], [])
    assert "\n" not in str(raised.value) and "Exception from src/" not in str(raised.value)


@pytest.fixture
def minilm_int8(minilm_int8_artifact: Path) -> Path:
    return minilm_int8_artifact  # the session's, compiled once whichever worker asks first (tests/conftest.py)


def held_out() -> dict[str, np.ndarray]:
    with np.load(MINILM / "evaluation.npz") as archive:
        return {name: archive[name] for name in archive.files}


@needs_openvino
@pytest.mark.slow
def test_minilm_fp32_and_its_int8_qdq_cpu_variant_run_on_openvino(minilm_int8: Path) -> None:
    manifest = read_manifest(minilm_int8)
    inputs, outputs = specs(manifest)
    feeds = held_out()
    reference = ort_run(minilm_int8 / "model.onnx", feeds)
    with OpenVinoBackend(minilm_int8 / "model.onnx", inputs, outputs, manifest.dims, threads=2) as backend:
        fp32 = backend.run(feeds)
    assert list(fp32) == ["token_embeddings", "sentence_embedding"]
    for name in reference:
        assert mean_cosine(reference[name], fp32[name]) >= 0.999, name

    variant = manifest.variant(next(t.variant for t in manifest.targets if t.name == "cpu"))
    assert variant.name == "cpu-int8"  # Q/DQ: QuantizeLinear/DequantizeLinear around every MatMul
    with OpenVinoBackend(minilm_int8 / variant.path, inputs, outputs, manifest.dims, threads=2) as backend:
        int8 = backend.run(feeds)
    quantized_on_onnxruntime = ort_run(minilm_int8 / variant.path, feeds)
    # Measured: 0.9936 against fp32 (ONNX Runtime's own run of the variant: 0.9966), 0.995 against ONNX Runtime
    # on the same file; OpenVINO runs the Q/DQ pairs as its int8 kernels with its own rounding.
    assert mean_cosine(reference["sentence_embedding"], int8["sentence_embedding"]) >= 0.99
    assert mean_cosine(quantized_on_onnxruntime["sentence_embedding"], int8["sentence_embedding"]) >= 0.99


@pytest.fixture
def tinylm(tinylm_dynamic_cache_artifact: Path) -> Path:
    return tinylm_dynamic_cache_artifact  # the growing cache (tests/conftest.py); the static one is tested below


@needs_openvino
def test_a_static_cache_decoder_generates_and_serves_on_openvino_as_on_onnxruntime(tinylm_cpu_artifact: Path) -> None:
    """The static cache's TensorScatter and grouped-query Attention through runtime/openvino_ops.py: `generate`
    and the continuous-batching engine (4 requests over 3 slots, so that one waits for a freed slot) give ONNX
    Runtime's greedy tokens."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 200, (length,)).astype(np.int64) for length in (5, 17, 9, 30)]
    with load(tinylm_cpu_artifact, backend="onnxruntime") as reference:
        expected = [reference.generate(p[None], max_new_tokens=10, eos_token_id=[])[0, len(p) :] for p in prompts]
    with load(tinylm_cpu_artifact, backend="openvino") as model:
        assert model.backend == "openvino:CPU"
        for prompt, tokens in zip(prompts, expected, strict=True):
            np.testing.assert_array_equal(
                model.generate(prompt[None], max_new_tokens=10, eos_token_id=[])[0, len(prompt) :], tokens
            )
        with model.engine(slots=3) as engine:
            streams = [engine.submit(prompt, max_new_tokens=10, ignore_eos=True) for prompt in prompts]
            served = [[int(token) for token in stream] for stream in streams]
    assert served == [tokens.tolist() for tokens in expected]


@needs_openvino
@pytest.mark.slow
def test_tinylm_generates_the_same_greedy_tokens_on_openvino(tinylm: Path) -> None:
    manifest = read_manifest(tinylm)
    inputs, outputs = specs(manifest)
    variant = manifest.variant(next(t.variant for t in manifest.targets if t.name == "cpu"))  # what load() runs
    backend = OpenVinoBackend(tinylm / variant.path, inputs, outputs, manifest.dims, threads=2)
    prompt = np.array([[1, 5, 9]], np.int64)
    with Model(tinylm, manifest, backend, None) as model, load(tinylm, backend="onnxruntime") as reference:
        assert model.backend == "openvino:CPU"
        tokens = model.generate(prompt, max_new_tokens=8)
        np.testing.assert_array_equal(tokens, reference.generate(prompt, max_new_tokens=8))
    assert tokens.shape == (1, 11)


@needs_openvino
def test_load_runs_the_backend_the_manifest_records_and_falls_back_saying_why(
    tinylm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cpu variant recorded as `backend: openvino` loads on OpenVINO; without OpenVINO, on ONNX Runtime with the
    reason; `backend="onnxruntime"` forces ONNX Runtime."""
    import json
    import shutil

    import tensorsmith.runtime.openvino_backend as openvino_backend

    copy = tmp_path / "artifact"
    shutil.copytree(tinylm, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    cpu = next(target["variant"] for target in manifest["targets"] if target["name"] == "cpu")
    for variant in manifest["variants"]:
        if variant["name"] == cpu:
            variant["backend"] = "openvino"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    prompt = np.array([[1, 5, 9]], np.int64)
    with load(copy) as model, load(copy, backend="onnxruntime") as forced:
        assert model.backend == "openvino:CPU" and forced.backend == "onnxruntime:CPUExecutionProvider"
        np.testing.assert_array_equal(
            model.generate(prompt, max_new_tokens=4), forced.generate(prompt, max_new_tokens=4)
        )
    monkeypatch.setattr(openvino_backend, "openvino_unavailable", lambda: "openvino is not installed")
    with load(copy) as model:
        assert model.backend == "onnxruntime:CPUExecutionProvider"
        assert model.fallback_reason is not None and "chose OpenVINO" in model.fallback_reason
    with pytest.raises(RuntimeLoadError, match="cannot load .* on OpenVINO: openvino is not installed"):
        load(copy, backend="openvino")
