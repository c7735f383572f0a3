"""Flooring Softmax logits at (row max − 80): the same outputs in fp32, padded keys included, on every opset
form of ReduceMax, and softmax axes other than the last."""

import numpy as np
import onnx
import pytest
import torch

from tensorsmith.passes.softmax_floor import FloorSoftmaxLogits
from tests.passes.graphs import GraphBuilder, apply, ops, run_onnx

BATCH, HEADS, LENGTH, WIDTH = 4, 2, 16, 8


class MaskedAttention(torch.nn.Module):
    """Eager attention with the additive padding mask transformers builds (finfo.min on padded keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH * HEADS, 3 * WIDTH * HEADS)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (HEADS, WIDTH)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        weights = torch.softmax(q @ k.transpose(-1, -2) / WIDTH**0.5 + bias, dim=-1)
        return (weights @ v).transpose(1, 2).flatten(2)


@pytest.fixture(scope="module")
def attention() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    torch.manual_seed(0)
    x = torch.randn(BATCH, LENGTH, WIDTH * HEADS) * 3
    mask = torch.ones(BATCH, LENGTH, dtype=torch.int64)
    mask[1, 10:] = 0
    mask[2, 3:] = 0
    program = torch.onnx.export(MaskedAttention().eval(), (x, mask), dynamo=True, input_names=["x", "mask"])
    assert program is not None
    return program.model_proto, {"x": x.numpy(), "mask": mask.numpy()}


def test_floored_attention_gives_the_same_outputs(attention: tuple[onnx.ModelProto, dict[str, np.ndarray]]) -> None:
    model, feeds = attention
    floored, (report,) = apply(model, [FloorSoftmaxLogits()])
    assert report.counts == {"softmax_floored": 1, "skipped": 0}
    assert ops(floored)["ReduceMax"] == ops(model).get("ReduceMax", 0) + 1
    np.testing.assert_allclose(run_onnx(floored, feeds)[0], run_onnx(model, feeds)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("opset", "axis"), [(17, -1), (18, -1), (20, 1)])
def test_weights_below_the_floor_stay_negligible(opset: int, axis: int) -> None:
    """Logits 1e4 and finfo.min below the max (masked keys) and 200 above the rest: same softmax in fp32."""
    b = GraphBuilder(opset)
    y = b.op("Softmax", "x", axis=axis)
    model = b.model({"x": (onnx.TensorProto.FLOAT, [3, 6, 5])}, {y: onnx.TensorProto.FLOAT})
    x = np.random.default_rng(1).standard_normal((3, 6, 5)).astype(np.float32)
    x[0, 0, 0], x[1, 2, 1], x[2, 1, 3] = -1e4, np.finfo(np.float32).min, 200.0
    floored, (report,) = apply(model, [FloorSoftmaxLogits()])
    assert report.changed
    expected, actual = run_onnx(model, {"x": x})[0], run_onnx(floored, {"x": x})[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-30)
    assert np.all(actual[expected == 0] < 1e-34)  # what was exactly 0 is now below 1.8e-35 at most
