"""The two PyTorch exporters, as tensorsmith calls them: torch's dynamo exporter with dynamic shapes from the
declared dims, and the TorchScript exporter; both kept quiet (their output and warnings go to the log and the
manifest, not the user's terminal)."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.transposed_weights import fold_weight_transposes
from tensorsmith.core.errors import ExportError
from tensorsmith.core.importing import first_line
from tensorsmith.core.ir import save_ir
from tensorsmith.core.referring_ir import referred, save_referring

if TYPE_CHECKING:
    import onnx_ir as ir
    import torch
    from torch.export import Dim
    from torch.onnx import ONNXProgram

logger = logging.getLogger("tensorsmith.compiler.frontend.export")  # one logger for the export, as before
TORCHSCRIPT_MAX_OPSET = 20
EXPORTED_NAME = "exported.onnx"  # the dynamo export's file in the scratch directory

MAX_WARNINGS = 50  # kept in the manifest; the rest are counted


@contextlib.contextmanager
def quiet_exporter(kept: list[str]) -> Iterator[None]:
    """The exporters print progress to stdout and raise many warnings about torch internals: keep both out of
    the user's terminal and --json output. The warnings go to `kept` (one line each, once) and the -v log; the
    printed output to the debug log."""
    captured = io.StringIO()
    # torch's loggers (its own handlers on stderr, below "torch" and its level) log errors as the export fails:
    # "E1201 … torch/export/_trace.py:1323] always_classified is unsupported." and fake tensors' tracebacks. The
    # compile reports the failure itself, so these show with -v only (and torch's info with -vv).
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    if not logger.isEnabledFor(logging.DEBUG):
        torch_logger.setLevel(max(level, logging.ERROR if logger.isEnabledFor(logging.INFO) else logging.CRITICAL))
    try:
        with contextlib.redirect_stdout(captured), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        torch_logger.setLevel(level)
    lines = dict.fromkeys(f"{w.category.__name__}: {(str(w.message).strip().splitlines() or [''])[0]}" for w in caught)
    for line in lines:
        logger.info("exporter warning: %s", line)
    kept += list(lines)[:MAX_WARNINGS]
    if len(lines) > MAX_WARNINGS:
        kept.append(f"… and {len(lines) - MAX_WARNINGS} more")
    if captured.getvalue().strip():
        logger.debug("exporter output:\n%s", captured.getvalue().rstrip())


def exporter_cause(err: BaseException) -> str:
    """An exporter's error as one line, its innermost cause's: the dynamo exporter raises one whose first line
    says only which of its steps failed ("… Next steps:"), from torch.export's (or the translation's) own."""
    while err.__cause__ is not None:
        err = err.__cause__
    return first_line(err)


def _dynamic_shapes(config: CompileConfig) -> dict[str, dict[int, Dim]]:
    import torch

    dims: dict[str, Dim] = {}
    shapes: dict[str, dict[int, Dim]] = {}
    for decl in config.inputs:
        axes = {}
        for axis, dim in enumerate(decl.dims):
            if isinstance(dim, str):
                if dim not in dims:
                    limits = config.dims.get(dim)
                    kwargs = {"max": limits.max} if limits and limits.max else {}
                    dims[dim] = torch.export.Dim(dim, **kwargs)
                axes[axis] = dims[dim]
        shapes[decl.name] = axes
    return shapes


def _shapes_for_signature(
    module: torch.nn.Module, shapes: list[dict[int, Dim]]
) -> tuple[dict[int, Dim] | tuple[dict[int, Dim], ...], ...]:
    """torch.export takes dynamic shapes shaped like forward's signature: the inputs a `*args` parameter takes
    (a decoder's past tensors) as one tuple in its place."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return tuple(shapes)
    for index, parameter in enumerate(parameters):
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return (*shapes[:index], tuple(shapes[index:]))
    return tuple(shapes)


def export_dynamo(
    module: torch.nn.Module | torch.export.ExportedProgram,
    config: CompileConfig,
    feeds: dict[str, np.ndarray],
    output_names: list[str] | None,
    warned: list[str],
    scratch: Path | None = None,
) -> onnx.ModelProto:
    return released_proto(dynamo_program(module, config, feeds, output_names, warned).model, scratch)


def released_proto(model: ir.Model, scratch: Path | None = None) -> onnx.ModelProto:
    """The onnx-ir `model` as a ModelProto, its own tensors then dropped, and onnxscript's matchers made to forget
    it. Its rewrite rules keep the last graph they matched, and the exporter's initializers are views of the
    torch module's parameters: without this the module's weights stay alive to the end of the compile.

    Given a `scratch` directory, a graph whose weights are above EXTERNAL_DATA_ABOVE is written there (its weights
    straight from the module's memory into `exported.onnx.data`) and the proto returned is its structure, each
    weight an external reference by absolute path: the weights are not copied into a protobuf (at 1B, 5 GB).
    Either way Linear's transposed weights are written transposed (transposed_weights.py)."""
    import onnx_ir as ir

    folded = fold_weight_transposes(model)
    logger.debug("the export: %d weights written transposed", folded)
    if scratch is None:
        proto = ir.to_proto(model)
    else:
        path = scratch / EXPORTED_NAME
        if referred(model):  # weights kept in the checkpoint's files (core/checkpoint_references.py)
            proto = save_referring(model, path)
        else:
            save_ir(model, path)
            proto = onnx.load(str(path), load_external_data=False)
        absolute_locations(proto, scratch)
    for graph in model.graphs():
        for value in graph.initializers.values():
            value.const_value = None
    _forget_rewriter_matches()
    return proto


def absolute_locations(model: onnx.ModelProto, base: Path) -> None:
    """Point every external weight of `model` at its file by absolute path, so that it reads from anywhere."""
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = str((base / entry.value).resolve())


def dynamo_program(
    module: torch.nn.Module | torch.export.ExportedProgram,
    config: CompileConfig,
    feeds: dict[str, np.ndarray],
    output_names: list[str] | None,
    warned: list[str],
    optimize: bool = True,
) -> ONNXProgram:
    """The dynamo exporter's ONNXProgram (its onnx-ir model is `.model`)."""
    import torch

    names = [decl.name for decl in config.inputs]
    args = tuple(torch.from_numpy(feeds[name]) for name in names)
    with quiet_exporter(warned):
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            opset_version=config.opset,
            input_names=names,
            output_names=output_names,
            # An ExportedProgram carries its own dynamic shapes.
            dynamic_shapes=None
            if isinstance(module, torch.export.ExportedProgram)
            else _shapes_for_signature(module, list(_dynamic_shapes(config).values())),
            verbose=False,
            optimize=optimize,
        )
    if program is None:  # only None when f= is given; keeps the type checker honest
        raise ExportError("the dynamo exporter returned no program")
    return program


def _forget_rewriter_matches() -> None:
    """Clear what onnxscript's pattern matchers keep of their last match. Its rewrite rules are module-level
    objects, and each matcher keeps the graph it last matched in (`_graph`, `_match`): clearing the graph's
    initializers was not enough, a value the optimizer had taken out of the graph still held the module's 1.05 GB
    embedding table (the Llama-3.2-1B shape) through every later step of the compile."""
    import gc
    import weakref

    try:
        from onnxscript.rewriter._matcher import PatternMatcher
    except ImportError:  # another onnxscript: nothing known to clear
        return
    for matcher in gc.get_objects():
        # a proxy whose object was collected raises on isinstance (a weak proxy torch.cond's trace left behind)
        if type(matcher) not in weakref.ProxyTypes and isinstance(matcher, PatternMatcher):
            for kept in ("_graph", "_match", "_current_node", "_tracer"):
                if kept in vars(matcher):
                    setattr(matcher, kept, None)


def export_torchscript(
    module: torch.nn.Module,
    config: CompileConfig,
    feeds: dict[str, np.ndarray],
    output_names: list[str] | None,
    warned: list[str],
) -> onnx.ModelProto:
    import torch

    names = [decl.name for decl in config.inputs]
    dynamic_axes = {
        decl.name: {axis: dim for axis, dim in enumerate(decl.dims) if isinstance(dim, str)} for decl in config.inputs
    }
    with tempfile.TemporaryDirectory(prefix="tensorsmith-export-") as scratch, quiet_exporter(warned):
        # A file, not a buffer: over 2 GB the exporter writes the weights beside it as external data.
        path = Path(scratch) / "model.onnx"
        torch.onnx.export(
            module,
            tuple(torch.from_numpy(feeds[name]) for name in names),
            path,
            dynamo=False,
            opset_version=min(config.opset, TORCHSCRIPT_MAX_OPSET),
            input_names=names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
        )
        return onnx.load(str(path))
