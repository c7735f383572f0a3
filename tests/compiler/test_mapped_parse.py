"""TensorRT's parser reads the weights from maps of their file, whose pages the build lets go of
(compiler/engines/mapped_parse.py): real tensorrt-rtx builds."""

import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorsmith.compiler.config import BuildConfig
from tensorsmith.compiler.engines import mapped_parse
from tensorsmith.compiler.engines.builder import _build, build_engine, import_builder
from tensorsmith.compiler.engines.mapped_parse import MappedWeights, parsed_network
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.core.errors import BuildError

PROFILE = Profile({"x": ((1, 64), (4, 64), (8, 64))})


def _matmul_chain(path: Path, layers: int = 3, external: bool = True) -> Path:
    """x [batch, 64] fp16 through `layers` MatMuls, the weights in `<name>.data` (external) or inside."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal((64, 64)) * 0.1).astype(np.float16), f"w{i}")
               for i in range(layers)]  # fmt: skip
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"], [f"h{i}"]) for i in range(layers)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["b", 64])],
                              [helper.make_tensor_value_info(f"h{layers - 1}", TensorProto.FLOAT16, ["b", 64])],
                              weights)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=external, location=f"{path.name}.data", size_threshold=0)
    return path


def _mapped_count(path: Path) -> int:
    trt = import_builder("tensorrt-rtx")
    logger = trt.Logger(trt.Logger.ERROR)
    with parsed_network(trt, trt.Builder(logger), logger, path, 0) as (network, weights):
        assert network.num_layers >= 3
        return len(weights.maps)


def test_external_weights_are_parsed_from_a_map_and_inline_ones_from_the_file(tmp_path: Path) -> None:
    assert _mapped_count(_matmul_chain(tmp_path / "external.onnx")) == 1
    assert _mapped_count(_matmul_chain(tmp_path / "inline.onnx", external=False)) == 0


def test_the_plan_is_the_one_the_parser_builds_from_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both built in this process (build_engine's child would not see the monkeypatch)."""
    path = _matmul_chain(tmp_path / "chain.onnx")
    trt = import_builder("tensorrt-rtx")
    mapped = _build(trt, path, "sm_86", [PROFILE], "tensorrt-rtx", BuildConfig()).plan
    monkeypatch.setattr(mapped_parse, "_external_weights", lambda structure, directory: None)  # parse_from_file
    from_file = _build(trt, path, "sm_86", [PROFILE], "tensorrt-rtx", BuildConfig()).plan
    assert len(mapped) > 20_000 and from_file == mapped


def test_a_truncated_weights_file_is_one_error_naming_the_weight(tmp_path: Path) -> None:
    path = _matmul_chain(tmp_path / "chain.onnx")
    data = tmp_path / "chain.onnx.data"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(BuildError, match=r"weight 'w2' of chain.onnx lies past the end of .*chain.onnx.data"):
        build_engine(path, "sm_86", PROFILE)


def _resident_file_bytes() -> int:
    """Mapped file pages resident: RssFile, or RssShmem where the file is on tmpfs."""
    status = Path("/proc/self/status").read_text()
    return sum(int(status.split(f"{field}:")[1].split()[0]) * 1024 for field in ("RssFile", "RssShmem"))


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc")
def test_shedding_lets_go_of_the_mapped_pages(tmp_path: Path) -> None:
    size = 64 << 20
    file = tmp_path / "weights.data"
    file.write_bytes(np.arange(size // 8, dtype=np.int64).tobytes())
    weights = MappedWeights()
    try:
        address = weights.address(file)
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int64 * (size // 8)).from_address(address))
        before = _resident_file_bytes()
        assert int(view.sum()) == (size // 8) * (size // 8 - 1) // 2  # every page read
        assert _resident_file_bytes() - before > size // 2
        with weights.shedding():
            time.sleep(10 * mapped_parse.SHED_SECONDS)
            assert _resident_file_bytes() - before < size // 4
            assert int(view[-1]) == size // 8 - 1  # read again: the file's bytes
        del view
    finally:
        weights.close()
