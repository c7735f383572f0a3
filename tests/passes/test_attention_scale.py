"""Attention-scale folding on a hand-built attention block."""

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from tensorsmith.passes import ATTENTION_SCALE, Fuse
from tests.passes.graphs import GraphBuilder, apply, assert_same_outputs, ops

HIDDEN, HEADS, SEQUENCE = 16, 2, 5
HEAD = HIDDEN // HEADS
RNG = np.random.default_rng(0)


def attention(scale: str = "div", q_also_output: bool = False, k_bias: bool = True) -> onnx.ModelProto:
    g = GraphBuilder(20)

    def heads(tensor: str) -> str:
        split = g.op("Reshape", tensor, g.const([1, SEQUENCE, HEADS, HEAD], np.int64))
        return g.op("Transpose", split, perm=[0, 2, 1, 3])

    def projection(bias: bool = True) -> str:
        out = g.op("MatMul", "x", g.const(RNG.standard_normal((HIDDEN, HIDDEN)) * 0.3))
        return g.op("Add", g.const(RNG.standard_normal(HIDDEN)), out) if bias else out

    q_projected = projection()
    q, k, v = heads(q_projected), heads(projection(k_bias)), heads(projection())
    scores = g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2]))
    if scale == "div":
        scaled = g.op("Div", scores, g.const(math.sqrt(HEAD)))
    else:
        scaled = g.op("Mul", g.const(1 / math.sqrt(HEAD)), scores)
    masked = g.op("Add", scaled, "mask")
    context = g.op("MatMul", g.op("Softmax", masked, axis=-1), v)
    outputs = {context: TensorProto.FLOAT}
    if q_also_output:
        outputs[q_projected] = TensorProto.FLOAT
    return g.model(
        {"x": (TensorProto.FLOAT, [1, SEQUENCE, HIDDEN]), "mask": (TensorProto.FLOAT, [1, 1, 1, SEQUENCE])}, outputs
    )


FEEDS = {
    "x": RNG.standard_normal((1, SEQUENCE, HIDDEN)).astype(np.float32),
    "mask": np.array([[[[0, 0, 0, -1e4, -1e4]]]], np.float32),
}


def test_div_scale_folds_into_the_q_projection() -> None:
    model = attention("div")
    fused, (report,) = apply(model, [Fuse([ATTENTION_SCALE])])
    assert report.counts["attention_scale.matched"] == 1, report.details
    assert ops(fused)["Div"] == 0
    assert ops(fused)["MatMul"] == ops(model)["MatMul"]
    assert_same_outputs(model, fused, FEEDS)


def test_mul_scale_on_the_left_folds_too() -> None:
    model = attention("mul")
    fused, (report,) = apply(model, [Fuse([ATTENTION_SCALE])])
    assert report.counts["attention_scale.matched"] == 1
    assert ops(fused)["Mul"] == 0
    assert_same_outputs(model, fused, FEEDS)


def test_a_q_used_elsewhere_folds_into_k_instead() -> None:
    model = attention("div", q_also_output=True, k_bias=False)
    fused, (report,) = apply(model, [Fuse([ATTENTION_SCALE])])
    assert report.counts["attention_scale.matched"] == 1
    assert_same_outputs(model, fused, FEEDS)  # Q's own output is unchanged


def test_a_softmax_that_is_not_attention_is_a_miss() -> None:
    g = GraphBuilder(20)
    out = g.op("Softmax", g.op("MatMul", "x", g.const(np.ones((4, 3)))), axis=-1)
    model = g.model({"x": (TensorProto.FLOAT, [2, 4])}, {out: TensorProto.FLOAT})
    fused, (report,) = apply(model, [Fuse([ATTENTION_SCALE])])
    assert report.counts["attention_scale.missed"] == 1
    assert ops(fused) == ops(model)


def test_the_scale_split_over_q_and_k_by_torchs_sdpa_folds(tmp_path: Path) -> None:
    """torch's scaled_dot_product_attention (TorchScript export): d^-¼ on q and on kᵀ, a Where-built mask added
    before Softmax; both scales fold into the Q projection."""
    import torch

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.q, self.k, self.v = (torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(3))

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            def heads(t: torch.Tensor) -> torch.Tensor:
                return t.view(x.shape[0], x.shape[1], HEADS, HEAD).transpose(1, 2)

            keep = mask[:, None, None, :].bool()
            return torch.nn.functional.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)),
                                                                    heads(self.v(x)), attn_mask=keep)  # fmt: skip

    x = torch.randn(2, SEQUENCE, HIDDEN)
    mask = torch.ones(2, SEQUENCE, dtype=torch.int64)
    mask[1, -2:] = 0
    path = tmp_path / "sdpa.onnx"
    torch.onnx.export(Attention().eval(), (x, mask), str(path), dynamo=False, opset_version=17,
                      input_names=["x", "mask"])  # fmt: skip
    source = onnx.load(str(path))
    from tensorsmith.passes import Canonicalize

    canonical, _ = Canonicalize(opset=20)(source)
    fused, reports = apply(canonical, [Fuse((ATTENTION_SCALE,))])
    assert reports[0].counts["attention_scale.matched"] == 1, reports[0].details
    assert ops(fused)["Mul"] < ops(canonical)["Mul"]
    assert_same_outputs(source, fused, {"x": x.numpy(), "mask": mask.numpy()})


def test_a_bias_that_layers_share_gets_a_scaled_copy_of_its_own_name_in_each() -> None:
    """An exporter stores equal biases once (a fresh checkpoint's zeros; here random values, read by the Q
    projection of two layers): each layer folds its scale into its own copy."""
    g = GraphBuilder(20)
    shared = g.const(RNG.standard_normal(HIDDEN))

    def heads(tensor: str) -> str:
        return g.op("Transpose", g.op("Reshape", tensor, g.const([1, SEQUENCE, HEADS, HEAD], np.int64)),
                    perm=[0, 2, 1, 3])  # fmt: skip

    def layer(x: str) -> str:
        q, k, v = (g.op("MatMul", x, g.const(RNG.standard_normal((HIDDEN, HIDDEN)) * 0.3)) for _ in range(3))
        scores = g.op("MatMul", heads(g.op("Add", shared, q)), g.op("Transpose", heads(k), perm=[0, 1, 3, 2]))
        weights = g.op("Softmax", g.op("Add", g.op("Div", scores, g.const(math.sqrt(HEAD))), "mask"), axis=-1)
        context = g.op("Transpose", g.op("MatMul", weights, heads(v)), perm=[0, 2, 1, 3])
        return g.op("Reshape", context, g.const([1, SEQUENCE, HIDDEN], np.int64))

    model = g.model({"x": (TensorProto.FLOAT, [1, SEQUENCE, HIDDEN]), "mask": (TensorProto.FLOAT, [1, 1, 1, SEQUENCE])},
                    {layer(layer("x")): TensorProto.FLOAT})  # fmt: skip
    fused, (report,) = apply(model, [Fuse([ATTENTION_SCALE])])  # run_passes refuses two tensors of one name
    assert report.counts["attention_scale.matched"] == 2, report.details
    scaled = [init.name for init in fused.graph.initializer if init.name.startswith(f"{shared}/attention_scaled")]
    assert len(set(scaled)) == 2
    assert_same_outputs(model, fused, FEEDS)
