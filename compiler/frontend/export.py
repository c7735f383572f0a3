"""Turn a source (factory + checkpoint, .pt2 ExportedProgram, .onnx) into an ONNX model.

PyTorch sources go through torch's dynamo exporter with dynamic shapes; when it fails, the TorchScript exporter
is tried and the manifest records which one ran and why. torch is imported only here, and only when needed.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from tensorsmith.compiler.config import CompileConfig, InputDecl
from tensorsmith.compiler.frontend.checkpoint import load_checkpoint
from tensorsmith.compiler.frontend.huggingface import build_module
from tensorsmith.compiler.frontend.source import Source
from tensorsmith.core.errors import ConfigError, ExportError
from tensorsmith.core.importing import first_line, import_factory

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TORCHSCRIPT_MAX_OPSET = 20
Reference = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


@dataclass
class ExportedModel:
    model: onnx.ModelProto
    exporter: str  # "dynamo", "torchscript" or "none" (an ONNX source)
    fallback_reason: str | None = None
    # Computes the source model's outputs for feeds, to verify the compiled graph against (None for ONNX).
    reference: Reference | None = None
    warnings: list[str] = field(default_factory=list)  # torch's and onnx's, during the export (for the manifest)


def _build_module(config: CompileConfig) -> torch.nn.Module:
    import torch

    factory = import_factory(config.source)
    try:
        module = factory()
    except Exception as err:
        raise ExportError(f"factory {config.source} raised {first_line(err)}") from err
    if not isinstance(module, torch.nn.Module):
        raise ExportError(
            f"factory {config.source} returned a {type(module).__name__}, not a torch.nn.Module",
            hint="the factory must return the model to compile",
        )
    if config.checkpoint is not None:
        load_checkpoint(module, config.resolve(config.checkpoint))
    return module.eval()


def _flatten(value: Any) -> Iterator[Any]:
    """The tensors of a model's output, in order: a tensor, tuple/list, dict, or a HF-style ModelOutput."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _flatten(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flatten(item)
    elif value is not None:
        yield value


def _torch_reference(module: Callable[..., Any], names: list[str]) -> Reference:
    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        with torch.inference_mode():
            outputs = module(*(torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in names))
        return [tensor.detach().cpu().numpy() for tensor in _flatten(outputs)]

    return run


MAX_WARNINGS = 50  # kept in the manifest; the rest are counted


@contextlib.contextmanager
def _quiet_exporter(kept: list[str]) -> Iterator[None]:
    """The exporters print progress to stdout and raise many warnings about torch internals: keep both out of
    the user's terminal and --json output. The warnings go to `kept` (one line each, once) and the -v log; the
    printed output to the debug log."""
    captured = io.StringIO()
    # torch configures its own loggers when imported; quiet the exporter's unless we are debugging.
    exporter_logger = logging.getLogger("torch.onnx")
    level = exporter_logger.level
    if not logger.isEnabledFor(logging.DEBUG):
        exporter_logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(captured), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        exporter_logger.setLevel(level)
    lines = dict.fromkeys(f"{w.category.__name__}: {(str(w.message).strip().splitlines() or [''])[0]}" for w in caught)
    for line in lines:
        logger.info("exporter warning: %s", line)
    kept += list(lines)[:MAX_WARNINGS]
    if len(lines) > MAX_WARNINGS:
        kept.append(f"… and {len(lines) - MAX_WARNINGS} more")
    if captured.getvalue().strip():
        logger.debug("exporter output:\n%s", captured.getvalue().rstrip())


def _dynamic_shapes(config: CompileConfig) -> dict[str, dict[int, Any]]:
    import torch

    dims: dict[str, Any] = {}
    shapes: dict[str, dict[int, Any]] = {}
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


def _shapes_for_signature(module: Any, shapes: list[dict[int, Any]]) -> tuple[Any, ...]:
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


def _export_dynamo(
    module: torch.nn.Module | Any,
    config: CompileConfig,
    feeds: dict[str, np.ndarray],
    output_names: list[str] | None,
    warned: list[str],
) -> onnx.ModelProto:
    import torch

    names = [decl.name for decl in config.inputs]
    args = tuple(torch.from_numpy(feeds[name]) for name in names)
    is_program = isinstance(module, torch.export.ExportedProgram)
    with _quiet_exporter(warned):
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            opset_version=config.opset,
            input_names=names,
            output_names=output_names,
            # An ExportedProgram carries its own dynamic shapes.
            dynamic_shapes=None
            if is_program
            else _shapes_for_signature(module, list(_dynamic_shapes(config).values())),
            verbose=False,
        )
    if program is None:  # only None when f= is given; keeps the type checker honest
        raise ExportError("the dynamo exporter returned no program")
    return program.model_proto


def _export_torchscript(
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
    with tempfile.TemporaryDirectory(prefix="tensorsmith-export-") as scratch, _quiet_exporter(warned):
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


def _check_forward_arguments(module: torch.nn.Module, inputs: list[InputDecl]) -> None:
    try:
        parameters = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return
    names = [decl.name for decl in inputs]
    if parameters[: len(names)] != names and not any(p.startswith("*") for p in parameters):
        logger.warning(
            "declared inputs %s are fed positionally to %s.forward%s", names, type(module).__name__, tuple(parameters)
        )


def _export_torch(module: Any, config: CompileConfig, feeds: dict[str, np.ndarray]) -> ExportedModel:
    output_names = config.outputs or None
    reference = _torch_reference(module, [decl.name for decl in config.inputs])
    errors: list[str] = []
    if config.exporter in ("auto", "dynamo"):
        warned: list[str] = []
        try:
            model = _export_dynamo(module, config, feeds, output_names, warned)
            return ExportedModel(model, "dynamo", None, reference, warned)
        except Exception as err:  # the exporter raises many types; the reason goes into the manifest
            errors.append(f"dynamo: {first_line(err)}")
            logger.warning("dynamo exporter failed (%s)", errors[-1])
            logger.debug("dynamo exporter traceback", exc_info=True)
    if config.exporter in ("auto", "torchscript") and not _is_exported_program(module):
        warned = []
        try:
            model = _export_torchscript(module, config, feeds, output_names, warned)
            fallback = errors[0] if errors else None
            if fallback:
                logger.warning("exported with the TorchScript exporter instead")
            return ExportedModel(model, "torchscript", fallback, reference, warned)
        except Exception as err:
            errors.append(f"torchscript: {first_line(err)}")
    raise ExportError(
        f"could not export {config.source} to ONNX: {'; '.join(errors)}",
        hint="run with -v for the exporter's traceback; check the declared inputs match forward()'s arguments",
    )


def _is_exported_program(module: Any) -> bool:
    import torch

    return isinstance(module, torch.export.ExportedProgram)


def _load_exported_program(config: CompileConfig) -> Any:
    import torch

    path = config.resolve(config.source)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist", hint="check the SOURCE path")
    try:
        return torch.export.load(str(path))
    except Exception as err:
        raise ExportError(
            f"{path} is not a loadable ExportedProgram: {first_line(err)}",
            hint="save it with torch.export.save(torch.export.export(model, args), 'model.pt2')",
        ) from err


def export_source(source: Source, feeds: dict[str, np.ndarray]) -> ExportedModel:
    """Export the source to ONNX with `feeds` as example inputs (ONNX sources were loaded by `open_source`)."""
    config = source.config
    if source.onnx_model is not None:
        return ExportedModel(source.onnx_model, "none")
    if not config.inputs:
        raise ConfigError(
            f"source {config.source} needs its inputs declared",
            hint="add [[inputs]] to tensorsmith.toml or pass --input NAME:DTYPE:DIMS for each forward() argument",
        )
    if source.huggingface is not None:
        module = build_module(source.huggingface, [decl.name for decl in config.inputs])
        return _export_torch(module, config, feeds)
    if config.source_kind == "exported_program":
        program = _load_exported_program(config)
        exported = _export_torch(program, config, feeds)
        exported.reference = _torch_reference(program.module(), [decl.name for decl in config.inputs])
        return exported
    module = _build_module(config)
    _check_forward_arguments(module, config.inputs)
    return _export_torch(module, config, feeds)
