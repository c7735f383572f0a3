"""The source, opened before any work: an ONNX file is loaded and its inputs declared once, up front, so that
every later stage (and the checks before them) reads one config."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from tensorsmith.compiler.config import CompileConfig, InputDecl
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.ir import io_records, load_onnx, value_dims, value_record


@dataclass(frozen=True)
class Source:
    config: CompileConfig  # with an ONNX source's inputs declared
    onnx_model: onnx.ModelProto | None = None  # an ONNX source, loaded, with the declared dims applied


def open_source(config: CompileConfig) -> Source:
    """Load an ONNX source and declare its inputs (the flags', applied to the graph; else the file's own);
    PyTorch sources are exported later, by the export stage."""
    if config.source_kind != "onnx":
        return Source(config)
    origin = str(config.resolve(config.source))
    model = load_onnx(config.resolve(config.source))
    if config.inputs:
        apply_input_decls(model, config.inputs, origin)
        return Source(config, model)
    decls = []
    for record in io_records(model)[0]:
        if record.dtype == "unknown":
            raise ConfigError(f"input '{record.name}' of {origin} has no dtype", hint="declare it with --input")
        decls.append(InputDecl(name=record.name, dtype=record.dtype, dims=record.shape))
    return Source(config.model_copy(update={"inputs": decls}), model)


def apply_input_decls(model: onnx.ModelProto, decls: list[InputDecl], origin: str) -> None:
    """Set the declared dims (a name makes a dim dynamic) on an ONNX source's inputs; check names and dtypes.

    Shapes recorded downstream (value_info, outputs) were inferred from the old input shapes, so they are
    cleared and inferred again by the canonicalize pass.
    """
    graph_inputs = {value.name: value for value in model.graph.input}
    for decl in decls:
        value = graph_inputs.get(decl.name)
        if value is None:
            raise ConfigError(
                f"{origin} has no input '{decl.name}'",
                hint=f"its inputs are {[r.name for r in io_records(model)[0]]}",
            )
        actual = value_record(value).dtype
        if actual != decl.dtype:
            raise ConfigError(
                f"input '{decl.name}' of {origin} is {actual}, declared {decl.dtype}",
                hint=f"declare it as {decl.name}:{actual}:…",
            )
        shape = value.type.tensor_type.shape
        if shape.dim and len(shape.dim) != len(decl.dims):
            raise ConfigError(
                f"input '{decl.name}' of {origin} has rank {len(shape.dim)}, declared {decl.describe()}",
                hint=f"its shape is {value_dims(value)}",
            )
        del shape.dim[:]
        for dim in decl.dims:
            entry = shape.dim.add()
            if isinstance(dim, int):
                entry.dim_value = dim
            else:
                entry.dim_param = dim
    if decls:
        del model.graph.value_info[:]
        for output in model.graph.output:
            output.type.tensor_type.ClearField("shape")
