"""A saved graph run one group of layers at a time: the memory of a run is one group's weights and the values that
cross between groups, not the model's weights.

An ONNX Runtime session holds every weight of its graph from the moment it opens: at Llama-3.1-8B's shape the fp32
graph is 32 GB, more than the machine. `LayerwiseSession` cuts the graph's nodes into contiguous segments at the
decoder layers' boundaries (core/graph_segments.py), joined until each holds at least `min_bytes` of weights. Each
run opens one segment's session at a time (its structure is written beside the
graph, so that its weights are read from the graph's own external data file), runs every row through it, keeps the
values later segments or the caller need, and closes it. Model Optimizer's layerwise calibration works the same way
in PyTorch; this is the same on the graph every variant is measured on.

The outputs equal the whole graph's up to the last bits: ONNX Runtime fuses nothing across a cut (a residual Add
and the next layer's norm), so those sums may round otherwise. The object answers what the compiler asks of an ONNX
Runtime session (`run`, `get_inputs`, `get_outputs`).

A segment run once (`run`, or `run_each` over one batch) opens without ONNX Runtime's graph optimizations and memory
arena: folding each weight's Transpose and Cast and prepacking it cost more than running them once (Llama-3.2-1B's
verification: sessions opened in 17.2 s and ran in 0.3 s; unoptimized, 0.3 s and 7.6 s), and without the arena
each weight's widened copy goes back to the system after its MatMul (the stage's peak 3.05 -> 2.73 GB). A segment
holding (de)quantization nodes is opened optimized: the optimizers make the kernels its variant ships with.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import onnx

from tensorsmith.core.checkpoint_references import linked_bytes
from tensorsmith.core.graph_segments import Segment, segments
from tensorsmith.core.memory import available_memory, trim_heap
from tensorsmith.core.progress import LogReporter, Reporter
from tensorsmith.runtime.manifest import external_data_path

if TYPE_CHECKING:
    import onnxruntime

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Argument:
    """An input or output as ONNX Runtime's NodeArg describes it: name, shape (ints, dim names, None) and type."""

    name: str
    shape: list[int | str | None]
    type: str


def _element_types(structure: onnx.ModelProto) -> dict[str, int]:
    """Every value's element type: ONNX's shape inference, then, for what it does not know (ONNX Runtime's
    contrib ops: MatMulNBits, GroupQueryAttention), the type of the node's first typed input."""
    inferred = onnx.shape_inference.infer_shapes(structure, strict_mode=False)
    graph = inferred.graph
    types = {tensor.name: tensor.data_type for tensor in graph.initializer}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    for node in graph.node:
        first = next((types[name] for name in node.input if name in types), onnx.TensorProto.FLOAT)
        for name in node.output:
            types.setdefault(name, first)
    return types


def _argument(value: onnx.ValueInfoProto) -> Argument:
    tensor = value.type.tensor_type
    shape: list[int | str | None] = [
        dim.dim_value if dim.HasField("dim_value") else dim.dim_param or None for dim in tensor.shape.dim
    ]
    # ONNX Runtime's type names are ONNX's, in lower case: tensor(float), tensor(int64), tensor(float16)
    element = onnx.TensorProto.DataType.Name(tensor.elem_type or onnx.TensorProto.FLOAT).lower()
    return Argument(value.name, shape, f"tensor({element})")


# Layerwise runs: "auto" where a graph's stored weights exceed LAYERWISE_SHARE of the memory available when its
# session opens (a whole session holds more than the file: at the 8B shape, 12 GB for the 4.2 GB fp16 INT4 variant,
# ONNX Runtime's CPU provider computing it in fp32), in segments of LAYERWISE_SEGMENT_BYTES; "always", one layer a
# segment; "never".
Layerwise = Literal["auto", "always", "never"]
LAYERWISE_SHARE = 1 / 6
LAYERWISE_SEGMENT_BYTES = 512 << 20
# ONNX Runtime's optimizers turn these into the kernels a quantized variant runs with (DequantizeLinear -> MatMul
# into MatMulNBits at its accuracy level, Q/DQ pairs into int8 kernels): a segment holding them is measured optimized
QUANTIZATION_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
_LAYERWISE: list[tuple[str, Reporter | None]] = [("auto", None)]


@contextlib.contextmanager
def layerwise(mode: str, reporter: Reporter | None = None) -> Iterator[None]:
    """Sessions that measure a saved graph run it a layer at a time as `mode` says, inside the block; each run
    a counted task of `reporter`'s (its segments), where one is given."""
    previous, _LAYERWISE[0] = _LAYERWISE[0], (mode, reporter)
    try:
        yield
    finally:
        _LAYERWISE[0] = previous


def layerwise_segments(path: Path) -> int | None:
    """The weight bytes each segment of a layerwise run over the graph at `path` holds at least (0: one layer
    each), or None where a session should hold the whole graph."""
    if _LAYERWISE[0][0] == "always":
        return 0
    data = external_data_path(path)
    # a weight read from the checkpoint's bf16 bytes is held as fp32 (core/checkpoint_references.py)
    stored = (data.stat().st_size if data.is_file() else 0) + path.stat().st_size + 2 * linked_bytes(path)
    return LAYERWISE_SEGMENT_BYTES if runs_layerwise(stored) else None


def runs_layerwise(stored: int) -> bool:
    """Whether a graph of `stored` bytes of weights is run a layer at a time, as the mode inside says."""
    mode = _LAYERWISE[0][0]
    if mode != "auto":
        return mode == "always"
    available = available_memory()
    return available is not None and stored > available * LAYERWISE_SHARE


class LayerwiseSession:
    """An ONNX Runtime CPU session over the graph at `path`, run a segment at a time (the module's docstring)."""

    def __init__(
        self,
        path: Path,
        min_bytes: int,
        extra_outputs: Sequence[str] = (),
        disabled_optimizers: Sequence[str] = (),
        options: onnxruntime.SessionOptions | None = None,  # the caller's: quiet
        structure: onnx.ModelProto | None = None,
    ) -> None:
        """`structure`: the graph to run where it is not the file's own (its weights still read beside `path`)."""
        self.path = path
        self._options = options
        self._disabled = list(disabled_optimizers)
        structure = structure if structure is not None else onnx.load(str(path), load_external_data=False)
        self._structure = structure
        self._types = _element_types(structure)
        present = [output.name for output in structure.graph.output]
        self._outputs = [*present, *(name for name in extra_outputs if name not in present)]
        self.segments = segments(structure, min_bytes, self._outputs)
        logger.info(
            "%s runs a layer at a time: %d segments, at most %.2f GB of weights each",
            path.name,
            len(self.segments),
            max((s.weight_bytes for s in self.segments), default=0) / 1e9,
        )
        initializers = {tensor.name for tensor in structure.graph.initializer}
        self._inputs = [value for value in structure.graph.input if value.name not in initializers]
        declared = {value.name: value for value in [*structure.graph.output, *structure.graph.value_info]}
        self._output_args = [
            _argument(
                declared.get(
                    name, onnx.helper.make_tensor_value_info(name, self._types.get(name, onnx.TensorProto.FLOAT), None)
                )
            )
            for name in self._outputs
        ]

    def get_inputs(self) -> list[Argument]:
        return [_argument(value) for value in self._inputs]

    def get_outputs(self) -> list[Argument]:
        return list(self._output_args)

    def run(
        self,
        names: Sequence[str] | None,
        feeds: dict[str, np.ndarray],
        run_options: onnxruntime.RunOptions | None = None,
    ) -> list[np.ndarray]:
        """`names` (every output where None) on `feeds`, one segment's session open at a time."""
        wanted = list(names) if names else list(self._outputs)
        missing = [value.name for value in self._inputs if value.name not in feeds]
        if missing:  # as ONNX Runtime words it
            raise ValueError(f"Required inputs ({missing}) are missing from input feed ({list(feeds)}).")
        values = {value.name: feeds[value.name] for value in self._inputs}
        reporter = _LAYERWISE[0][1] or LogReporter()
        with reporter.task(f"{self.path.name}, a segment of layers at a time", len(self.segments)) as advance:
            plan = self._narrowed(set(wanted))
            for index, segment in enumerate(plan):
                if segment is None:  # nothing wanted from it
                    advance(1)
                    continue
                session = self._open(segment, runs_once=True)
                outputs = session.run(segment.outputs, {name: values[name] for name in segment.inputs}, run_options)
                del session
                values.update(zip(segment.outputs, (np.array(output) for output in outputs), strict=True))
                needed = set(wanted).union(*(later.inputs for later in plan[index + 1 :] if later is not None))
                values = {name: value for name, value in values.items() if name in needed}
                trim_heap()  # the session's arena and weights, given back before the next segment's are read
                advance(1)
        return [values[name] for name in wanted]

    def run_each(
        self,
        names: Sequence[str],
        batches: Sequence[dict[str, np.ndarray]],
        each: Callable[[int, str, np.ndarray], None],
    ) -> None:
        """`names` on every batch, one segment at a time over all the batches: each segment's weights are read
        once, not once a batch (a calibration pass over a decoder the size of the machine's memory reads them once
        instead of 56 times). `each(batch, name, value)` gets every value as its segment makes it, in batch order
        for any one name, and the value is dropped after unless a later segment reads it."""
        wanted = set(names)
        held = [{value.name: feeds[value.name] for value in self._inputs} for feeds in batches]
        reporter = _LAYERWISE[0][1] or LogReporter()
        title = f"{self.path.name}, a segment of layers at a time over {len(batches)} batches"
        with reporter.task(title, len(self.segments)) as advance:
            plan = self._narrowed(wanted)
            for index, segment in enumerate(plan):
                if segment is None:  # nothing wanted from it (the logits after the last observed layer)
                    advance(1)
                    continue
                later = set().union(*(following.inputs for following in plan[index + 1 :] if following is not None))
                session = self._open(segment, runs_once=len(held) == 1)
                for number, values in enumerate(held):
                    outputs = session.run(segment.outputs, {name: values[name] for name in segment.inputs})
                    # arrays that own their bytes: ONNX Runtime's outputs are views into the segment session's
                    # arena, and one kept for a later segment keeps that whole arena after the session is gone
                    made = dict(zip(segment.outputs, (np.array(output) for output in outputs), strict=True))
                    for name in (name for name in segment.outputs if name in wanted):
                        each(number, name, made[name])
                    held[number] = {name: value for name, value in {**values, **made}.items() if name in later}
                del session
                trim_heap()
                advance(1)

    def _narrowed(self, wanted: set[str]) -> list[Segment | None]:
        """Each segment narrowed to what `wanted` needs of it, walked from the last (None: none of it is needed)."""
        plan: list[Segment | None] = []
        needed = set(wanted)
        for whole in reversed(self.segments):
            outputs = [name for name in whole.outputs if name in needed]
            segment = whole.narrowed(outputs) if outputs else None
            needed.update(segment.inputs if segment is not None else ())
            plan.append(segment)
        return plan[::-1]

    def _open(self, segment: Segment, runs_once: bool) -> onnxruntime.InferenceSession:
        import onnxruntime  # heavy: only where a session opens

        graph = onnx.helper.make_graph(
            segment.nodes,
            self._structure.graph.name or "segment",
            [self._value(name) for name in segment.inputs],
            [self._value(name) for name in segment.outputs],
            segment.initializers,
        )
        model = onnx.helper.make_model(
            graph, opset_imports=self._structure.opset_import, ir_version=self._structure.ir_version
        )
        model.functions.extend(self._structure.functions)
        # beside the graph, where its external data's relative locations resolve (ONNX Runtime refuses absolute ones)
        with tempfile.NamedTemporaryFile(
            dir=self.path.parent, prefix=f".{self.path.stem}-segment-", suffix=".onnx"
        ) as written:
            written.write(model.SerializeToString())
            written.flush()
            unoptimized = runs_once and not any(node.op_type in QUANTIZATION_OPS for node in segment.nodes)
            return onnxruntime.InferenceSession(
                written.name,
                self._unoptimized() if unoptimized else self._options,
                providers=["CPUExecutionProvider"],
                disabled_optimizers=self._disabled,
            )

    def _unoptimized(self) -> onnxruntime.SessionOptions:
        """The caller's session options with ONNX Runtime's graph optimizations and arena off. Its logging and threads
        are copied: the only settings callers give today (core/sessions.py, core/tensor_ranges.py)."""
        import onnxruntime

        options = onnxruntime.SessionOptions()
        if self._options is not None:
            options.log_severity_level = self._options.log_severity_level
            options.intra_op_num_threads = self._options.intra_op_num_threads
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.enable_cpu_mem_arena = False
        return options

    def _value(self, name: str) -> onnx.ValueInfoProto:
        return onnx.helper.make_tensor_value_info(name, self._types.get(name, onnx.TensorProto.FLOAT), None)
