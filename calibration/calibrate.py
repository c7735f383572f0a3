"""Calibrate a graph: observe the activations that feed quantizable ops, then choose their thresholds."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import onnx_graphsurgeon as gs

from tensorsmith.calibration.data import CalibrationData
from tensorsmith.calibration.observer import Observer
from tensorsmith.calibration.table import CalibrationTable, Method, build_table
from tensorsmith.calibration.thresholds import DEFAULT_PERCENTILE
from tensorsmith.core.progress import Reporter
from tensorsmith.passes.quantize import activation_inputs, quantizable_nodes


def tensors_to_observe(model: onnx.ModelProto) -> list[str]:
    """The activations that feed MatMul/Gemm/Conv: the tensors the Q/DQ pass quantizes per tensor."""
    graph = gs.import_onnx(model)
    names = [tensor.name for node in quantizable_nodes(graph) for tensor in activation_inputs(node)]
    return list(dict.fromkeys(names))


def calibrate(
    model: onnx.ModelProto,
    data: CalibrationData,
    method: Method = "entropy",
    percentile: float = DEFAULT_PERCENTILE,
    tensors: Sequence[str] | None = None,
    reporter: Reporter | None = None,
) -> CalibrationTable:
    observer = Observer(model, tensors if tensors is not None else tensors_to_observe(model))
    statistics = observer.collect(data, reporter)
    return build_table(statistics.tensors, method, samples=statistics.samples, percentile=percentile)
