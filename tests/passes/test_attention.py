"""Attention decompositions → ONNX Attention (opset 23): transformers' Llama attention with grouped-query heads,
an additive mask and a KV cache, exported by the dynamo exporter; the fused graph gives the same outputs on ONNX
Runtime and builds for sm_86 with tensorrt-rtx. A Softmax that is no attention is a miss with its reason."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.passes import ATTENTION, ATTENTION_SCALE, Fuse
from tensorsmith.passes.fp16 import ConvertToFp16
from tests.passes.graphs import apply, assert_same_outputs, ops

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


class CachedAttention(nn.Module):
    """q from x; k and v from x appended to a past cache; heads repeated for GQA as transformers does."""

    def __init__(self, scale_inside: bool, head_dim: int = HEAD_DIM) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(32, HEADS * head_dim)
        self.kv = nn.Linear(32, 2 * KV_HEADS * head_dim)
        self.scale_inside, self.head_dim = scale_inside, head_dim

    def forward(self, x: torch.Tensor, mask: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor) -> tuple:
        from transformers.models.llama.modeling_llama import repeat_kv

        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, HEADS, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(batch, length, 2 * KV_HEADS, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        scores = q @ repeat_kv(k, HEADS // KV_HEADS).transpose(2, 3)
        if self.scale_inside:
            scores = scores / self.head_dim**0.5
        weights = torch.softmax(scores + mask, dim=-1)
        return (weights @ repeat_kv(v, HEADS // KV_HEADS)).transpose(1, 2).reshape(batch, length, -1), k, v


def _feeds(length: int = 3, past: int = 5, head_dim: int = HEAD_DIM) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    causal = np.triu(np.full((length, past + length), -1e9, np.float32), k=past + 1)
    mask = np.broadcast_to(causal, (2, 1, length, past + length)).copy()
    return {"x": rng.standard_normal((2, length, 32), np.float32), "mask": mask,
            "past_k": rng.standard_normal((2, KV_HEADS, past, head_dim), np.float32),
            "past_v": rng.standard_normal((2, KV_HEADS, past, head_dim), np.float32)}  # fmt: skip


def _export(module: CachedAttention, path: Path) -> onnx.ModelProto:
    feeds = {name: torch.from_numpy(value) for name, value in _feeds(head_dim=module.head_dim).items()}
    length, total, past = torch.export.Dim("length"), torch.export.Dim("total"), torch.export.Dim("past")
    shapes = {"x": {1: length}, "mask": {2: length, 3: total}, "past_k": {2: past}, "past_v": {2: past}}
    torch.onnx.export(module.eval(), tuple(feeds.values()), str(path), dynamo=True, opset_version=23,
                      input_names=list(feeds), dynamic_shapes=shapes)  # fmt: skip
    return onnx.load(str(path))


@pytest.mark.parametrize(
    ("scale_inside", "fold", "scale"), [(True, True, 1.0), (True, False, HEAD_DIM**-0.5), (False, False, 1.0)]
)
def test_grouped_query_attention_with_a_cache_fuses(
    tmp_path: Path, scale_inside: bool, fold: bool, scale: float
) -> None:
    """The scale folded into the q projection first (Attention's is then 1), or taken onto the node."""
    source = _export(CachedAttention(scale_inside), tmp_path / "attention.onnx")
    assert ops(source)["Softmax"] == 1 and ops(source)["Expand"] >= 2
    fused, reports = apply(source, [Fuse((ATTENTION_SCALE,))] * fold + [Fuse((ATTENTION,))])
    assert reports[-1].counts["attention.matched"] == 1, reports[-1].details
    counted = ops(fused)
    assert counted["Attention"] == 1 and counted["Softmax"] == 0 and counted["Expand"] == 0
    (node,) = [node for node in fused.graph.node if node.op_type == "Attention"]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["q_num_heads"] == HEADS and attributes["kv_num_heads"] == KV_HEADS
    assert attributes["scale"] == pytest.approx(scale)
    for feeds in (_feeds(), _feeds(length=1, past=7), _feeds(length=4, past=0)):  # prefill, decode, empty cache
        assert_same_outputs(source, fused, feeds)
    path = tmp_path / "fused.onnx"  # TensorRT for RTX builds Attention in fp16 (fp32 has no kernel)
    onnx.save(apply(fused, [ConvertToFp16()])[0], str(path))
    cache = ((2, KV_HEADS, 0, HEAD_DIM), (2, KV_HEADS, 5, HEAD_DIM), (2, KV_HEADS, 16, HEAD_DIM))  # batch static
    profile = Profile({"x": ((2, 1, 32), (2, 3, 32), (2, 8, 32)), "mask": ((2, 1, 1, 1), (2, 1, 3, 8), (2, 1, 8, 24)),
                       "past_k": cache, "past_v": cache})  # fmt: skip
    assert len(build_engine(path, "sm_86", profile).plan) > 0


def test_a_head_dim_tensorrt_has_no_kernel_for_is_a_miss(tmp_path: Path) -> None:
    fused, reports = apply(_export(CachedAttention(True, head_dim=8), tmp_path / "a.onnx"), [Fuse((ATTENTION,))])
    assert ops(fused)["Attention"] == 0
    assert "head_dim 8" in next(iter(reports[0].details.as_json()["reasons"]["attention"]))


class NotAttention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=1) @ x.transpose(1, 2)


def test_a_softmax_over_another_axis_is_a_miss(tmp_path: Path) -> None:
    path = tmp_path / "softmax.onnx"
    torch.onnx.export(NotAttention().eval(), (torch.randn(2, 3, 4),), str(path), dynamo=True, opset_version=23)
    fused, reports = apply(onnx.load(str(path)), [Fuse((ATTENTION,))])
    assert ops(fused)["Attention"] == 0 and reports[0].counts["attention.missed"] == 1
    assert "not the last" in next(iter(reports[0].details.as_json()["reasons"]["attention"]))
