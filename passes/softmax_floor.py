"""Floor every Softmax's logits at (row max − 80), so that ONNX Runtime's CPU Softmax stays on its fast path.

An additive attention mask puts finfo(float32).min (or −10000) on every padded key. ONNX Runtime's CPU Softmax
(MLAS) computes exp(x − max), and for x − max below about −87.3, where exp's result leaves fp32's normal range,
it ran 4–9x slower here: 0.86 ms instead of 0.16–0.20 ms for MiniLM's 8×12×64×64 scores with 24 of 64 keys
padded (its set_denormal_as_zero option covers its pool threads, not the calling thread that also runs part
of the work). Raising such a logit to max − 80 changes nothing fp32 can show: its weight was below
e^−80 ≈ 1.8e−35 of the largest, it becomes that, and the row's sum moves by at most (row length) · 1.8e−35,
some 28 orders of magnitude under fp32's resolution. The floor costs a ReduceMax, a Sub on the (…, 1) maxima
and a Max. Only for graphs ONNX Runtime runs on the CPU (the cpu variant): TensorRT fuses Softmax into its
attention kernels, which these extra ops would split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.passes.base import PassDetails, PassReport

MARGIN = 80.0  # below exp's fp32 underflow at −87.3, so e^−MARGIN is a normal number


class SoftmaxFloorDetails(PassDetails):
    margin: float


@dataclass
class FloorSoftmaxLogits:
    margin: float = MARGIN
    name: str = "floor_softmax_logits"

    def __call__(self, graph: gs.Graph) -> PassReport:
        floored, skipped = 0, 0
        for index, softmax in enumerate([node for node in graph.nodes if node.op == "Softmax"]):
            logits = softmax.inputs[0]
            if graph.opset < 13 or logits.dtype not in (np.float32, np.float16):
                skipped += 1  # before opset 13, Softmax flattens to 2-D and its axis means something else
                continue
            prefix = f"{softmax.name or 'softmax'}/floor_{index}"
            axis = int(softmax.attrs.get("axis", -1))
            inputs: list[gs.Tensor] = [logits]
            attrs: dict[str, object] = {"keepdims": 1}
            if graph.opset >= 18:  # ReduceMax takes its axes as an input from opset 18
                inputs.append(gs.Constant(f"{prefix}/axes", np.array([axis], np.int64)))
            else:
                attrs["axes"] = [axis]
            (row_max,) = graph.layer(
                op="ReduceMax", name=f"{prefix}/max", inputs=inputs, outputs=[f"{prefix}/max"], attrs=attrs
            )
            margin = gs.Constant(f"{prefix}/margin", np.array(self.margin, dtype=logits.dtype))
            (floor,) = graph.layer(
                op="Sub", name=f"{prefix}/floor", inputs=[row_max, margin], outputs=[f"{prefix}/floor"]
            )
            (raised,) = graph.layer(
                op="Max", name=f"{prefix}/raise", inputs=[logits, floor], outputs=[f"{prefix}/logits"]
            )
            for tensor in (row_max, floor, raised):
                tensor.dtype = logits.dtype
            softmax.inputs[0] = raised
            floored += 1
        return PassReport(
            self.name,
            changed=floored > 0,
            counts={"softmax_floored": floored, "skipped": skipped},
            details=SoftmaxFloorDetails(margin=self.margin),
        )
