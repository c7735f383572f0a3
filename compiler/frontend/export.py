"""Turn a source (factory + checkpoint, .pt2 ExportedProgram, .onnx) into an ONNX model.

PyTorch sources go through torch's dynamo exporter with dynamic shapes; when it fails, the TorchScript exporter
is tried and the manifest records which one ran and why. torch is imported only here, and only when needed.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tensorsmith.compiler.config import CompileConfig, InputDecl
from tensorsmith.compiler.frontend.checkpoint import load_checkpoint
from tensorsmith.compiler.frontend.exported import ExportedModel, torch_reference
from tensorsmith.compiler.frontend.exporters import export_dynamo, export_torchscript, exporter_cause
from tensorsmith.compiler.frontend.huggingface import build_module, export_hint
from tensorsmith.compiler.frontend.source import Source
from tensorsmith.compiler.frontend.stamped_export import (
    export_decoder_from_checkpoint,
    export_stamped,
    may_stream_weights,
    module_tensors,
)
from tensorsmith.core.errors import ConfigError, ExportError
from tensorsmith.core.importing import first_line, import_factory
from tensorsmith.core.progress import LogReporter, Reporter

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


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


FORWARD_HINT = "run with -v for the exporters' tracebacks; check the declared inputs match forward()'s arguments"


def _export_torch(
    module: torch.nn.Module | torch.export.ExportedProgram,
    config: CompileConfig,
    feeds: dict[str, np.ndarray],
    hint: str = FORWARD_HINT,
    scratch: Path | None = None,
) -> ExportedModel:
    import torch

    output_names = config.outputs or None
    reference = torch_reference(module, [decl.name for decl in config.inputs])
    failed: dict[str, Exception] = {}  # exporter → its error
    if config.exporter in ("auto", "dynamo"):
        warned: list[str] = []
        try:
            model = export_dynamo(module, config, feeds, output_names, warned, scratch)
            return ExportedModel(model, "dynamo", None, reference, warned)
        except Exception as err:  # the exporter raises many types; the reason goes into the manifest
            failed["dynamo"] = err
    if config.exporter in ("auto", "torchscript") and not isinstance(module, torch.export.ExportedProgram):
        warned = []
        try:
            model = export_torchscript(module, config, feeds, output_names, warned)
        except Exception as err:
            failed["torchscript"] = err
        else:
            dynamo = failed.get("dynamo")
            if dynamo is not None:
                logger.warning(
                    "the dynamo exporter failed (%s); exported with the TorchScript exporter instead",
                    exporter_cause(dynamo),
                )
                logger.debug("the dynamo exporter's traceback", exc_info=dynamo)
            fallback = None if dynamo is None else f"dynamo: {exporter_cause(dynamo)}"
            return ExportedModel(model, "torchscript", fallback, reference, warned)
    for name, error in failed.items():  # -v: the exporters' own tracebacks (the ExportError's is tensorsmith's)
        logger.info("the %s exporter's traceback", name, exc_info=error)
    causes = "; ".join(f"{name}: {exporter_cause(error)}" for name, error in failed.items())
    raise ExportError(f"could not export {config.source} to ONNX: {causes}", hint=hint)


def _load_exported_program(config: CompileConfig) -> torch.export.ExportedProgram:
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


def factory_module(config: CompileConfig) -> torch.nn.Module:
    """A factory source's module, its checkpoint loaded and its forward() checked against the declared inputs."""
    module = _build_module(config)
    _check_forward_arguments(module, config.inputs)
    return module


def export_source(
    source: Source,
    feeds: dict[str, np.ndarray],
    scratch: Path | None = None,
    module: torch.nn.Module | None = None,
    reporter: Reporter | None = None,
) -> ExportedModel:
    """Export the source to ONNX with `feeds` as example inputs (ONNX sources were loaded by `open_source`). With
    a `scratch` directory, the dynamo exporter's large graphs are written there and returned as their structure,
    the weights referenced by path (exporters.released_proto). A factory source's `module`, where the caller built
    it already (factory_module)."""
    config = source.config
    if source.onnx_model is not None:
        return ExportedModel(source.onnx_model, "none")
    if not config.inputs:
        raise ConfigError(
            f"source {config.source} needs its inputs declared",
            hint="add [[inputs]] to tensorsmith.toml or pass --input NAME:DTYPE:DIMS for each forward() argument",
        )
    if source.huggingface is not None:
        if may_stream_weights(source.huggingface, config):
            shown = reporter or LogReporter()
            streamed = export_decoder_from_checkpoint(source.huggingface, config, feeds, scratch, shown)
            if streamed is not None:
                return streamed
        module = build_module(source.huggingface, [decl.name for decl in config.inputs], config.mla_cache)
        stamped = (
            export_stamped(module, source.huggingface, config, feeds, scratch, module_tensors(module))
            if source.is_decoder
            else None
        )
        return stamped or _export_torch(module, config, feeds, export_hint(source.huggingface), scratch)
    if config.source_kind == "exported_program":
        program = _load_exported_program(config)
        exported = _export_torch(program, config, feeds, scratch=scratch)
        exported.reference = torch_reference(program.module(), [decl.name for decl in config.inputs])
        return exported
    return _export_torch(module or factory_module(config), config, feeds, scratch=scratch)
