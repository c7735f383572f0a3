"""What a real-scale checkpoint needs, checked on a tiny one with the thresholds turned down: graphs saved with
their weights as external data (and every stage after reading them: verification, variants, engines, the
runtime, Triton's copy), the records covering the weights, engine builds side by side, calibration batches
bounded by the activations they return."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.engines import records
from tensorsmith.compiler.frontend import fused
from tensorsmith.compiler.variants.text_data import OBSERVED_BYTES, calibration_batch
from tensorsmith.core import ir, narrow_twin
from tensorsmith.core.errors import ArtifactError
from tensorsmith.runtime import load

COMMON = {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@pytest.fixture(scope="module")
def external_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 4-layer Llama, saved in bf16, compiled for the cpu and sm_86 with every graph's weights saved outside it
    and model.onnx measured through its narrow twin (core/narrow_twin), as a real checkpoint's is."""
    import transformers

    directory = tmp_path_factory.mktemp("external")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, **COMMON)  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16).save_pretrained(directory / "checkpoint")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
        patch.setattr(narrow_twin, "SAVES_AT_LEAST", 0)
        twins: list[Path | None] = []
        patch.setattr(fused, "write_twin", lambda path: twins.append(narrow_twin.write_twin(path)) or twins[-1])
        compile(CompileConfig.create({"source": str(directory / "checkpoint"), "targets": ["cpu", "sm_86"]}),
                directory / "out")  # fmt: skip
    assert twins and twins[0] is not None  # the bf16 weights were measured in 16 bits
    return directory / "checkpoint", directory / "out"


def test_graphs_keep_their_weights_outside_and_every_stage_reads_them(external_artifact: tuple[Path, Path]) -> None:
    import transformers

    checkpoint, out = external_artifact
    for name in ("model.onnx", "variants/bf16.onnx"):  # a bf16 checkpoint's GPU variant: bf16
        assert (out / f"{name}.data").stat().st_size > (out / name).stat().st_size, name
    assert not [path for path in out.rglob("*") if "narrow-twin" in path.name]  # measuring only: not shipped
    model = load(out)
    prompt = np.array([[5, 9, 17, 33, 2, 71]], np.int64)
    reference = transformers.LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    expected = reference.generate(torch.from_numpy(prompt), max_new_tokens=8, do_sample=False)
    assert model.generate(prompt, max_new_tokens=8).tolist() == expected.tolist()  # greedy: the same tokens


def test_a_graph_s_record_covers_its_external_weights(external_artifact: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    _, out = external_artifact
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    data = copy / "model.onnx.data"
    damaged = bytearray(data.read_bytes())
    damaged[-1] ^= 0xFF
    data.write_bytes(bytes(damaged))
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        load(copy)


def test_engine_builds_run_side_by_side_as_cores_and_memory_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(records, "available_memory", lambda: 8 << 30)
    assert records.parallel_builds(3, 100 << 20) == 2  # two cores
    assert records.parallel_builds(1, 100 << 20) == 1
    assert records.parallel_builds(3, 2 << 30) == 1  # two builds of a 2 GB graph do not fit in 8 GB


def test_calibration_batches_are_bounded_by_what_they_return(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    hidden, vocabulary, length = 4096, 32000, 512
    # a 524 MB weight only its shape is read of: external data in a sparse file (nothing written, nothing parsed)
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[hidden, vocabulary],
                         data_location=TensorProto.EXTERNAL)  # fmt: skip
    for key, value in (("location", "model.onnx.data"), ("offset", "0"), ("length", str(4 * hidden * vocabulary))):
        weight.external_data.add(key=key, value=value)
    with (tmp_path / "model.onnx.data").open("wb") as data:
        data.truncate(4 * hidden * vocabulary)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, length, hidden])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, length, vocabulary])],
                              [weight])  # fmt: skip
    onnx.save(helper.make_model(graph), tmp_path / "model.onnx")
    config = CompileConfig.create({"source": str(tmp_path)})
    rows = calibration_batch(config, tmp_path / "model.onnx", length)
    assert rows == OBSERVED_BYTES // (4 * length * (hidden + vocabulary)) < config.calibration_batch_size
    given = CompileConfig.create({"source": str(tmp_path), "calibration_batch_size": 16})
    assert calibration_batch(given, tmp_path / "model.onnx", length) == 16  # as asked
