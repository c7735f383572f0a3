"""QuantizeEmbeddings: vocabulary tables stored in int8 with a scale per row, read through DequantizeLinear;
small tables (positions) untouched; ONNX Runtime runs it and TensorRT for RTX builds it."""

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.passes import run_passes
from tensorsmith.passes.embeddings import QuantizeEmbeddings

VOCABULARY, POSITIONS, WIDTH = 4096, 64, 32


def embedding_model(path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    words = (rng.standard_normal((VOCABULARY, WIDTH)) * rng.uniform(0.01, 3, (VOCABULARY, 1))).astype(np.float32)
    positions = rng.standard_normal((POSITIONS, WIDTH)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["words", "ids"], ["word_vectors"], axis=0, name="word_gather"),
        helper.make_node("Gather", ["positions", "position_ids"], ["position_vectors"], axis=0, name="pos_gather"),
        helper.make_node("Add", ["word_vectors", "position_vectors"], ["embedded"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "embeddings",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["batch", "sequence", WIDTH])],
        [numpy_helper.from_array(words, "words"), numpy_helper.from_array(positions, "positions")],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    return path, words, positions


@pytest.mark.parametrize("gather_first", [False, True], ids=["dequantize-then-gather", "gather-then-scale"])
def test_vocabulary_table_goes_int8_per_row_and_stays_close(tmp_path: Path, gather_first: bool) -> None:
    source, words, positions = embedding_model(tmp_path / "embeddings.onnx")
    graph = gs.import_onnx(onnx.load(str(source)))
    (report,) = run_passes(graph, [QuantizeEmbeddings(gather_first=gather_first)])
    assert report.counts["tables_quantized"] == 1 and report.details.as_json()["tables"] == ["words"]
    assert report.counts["bytes_saved"] > words.nbytes * 0.7
    quantized = tmp_path / "quantized.onnx"
    onnx.save(gs.export_onnx(graph), str(quantized))
    assert quantized.stat().st_size < source.stat().st_size * 0.4

    ids = np.random.default_rng(1).integers(0, VOCABULARY, (4, 16))
    position_ids = np.tile(np.arange(16), (4, 1))
    feeds = {"ids": ids, "position_ids": position_ids}
    (actual,) = onnxruntime.InferenceSession(str(quantized), providers=["CPUExecutionProvider"]).run(None, feeds)
    expected = words[ids] + positions[position_ids]
    row_step = np.abs(words).max(axis=1) / 127  # each row's own int8 step
    assert np.all(np.abs(actual - expected) <= row_step[ids][..., None] / 2 + 1e-6)

    ops = [node.op for node in graph.nodes]
    if gather_first:  # the cpu form: only gathered rows are scaled (ONNX Runtime runs no DQ of the table)
        assert "DequantizeLinear" not in ops and ops.count("Gather") == 3
        return
    assert ops.count("DequantizeLinear") == 1  # the TensorRT form: it folds the DQ into the engine
    engine = build_engine(quantized, "sm_86", Profile({name: ((1, 1), (4, 16), (8, 64)) for name in feeds}))
    assert len(engine.plan) > 0
