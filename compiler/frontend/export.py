"""Turn a source (factory + checkpoint, .pt2 ExportedProgram, .onnx) into an ONNX model.

PyTorch sources go through torch's dynamo exporter with dynamic shapes; when it fails, the TorchScript exporter
is tried and the manifest records which one ran and why. torch is imported only here, and only when needed.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from tensorsmith.compiler.config import CompileConfig, InputDecl
from tensorsmith.compiler.frontend.checkpoint import load_checkpoint
from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights, weights_while_running
from tensorsmith.compiler.frontend.decoder import kv_layout, past_names, present_names
from tensorsmith.compiler.frontend.exporters import (
    dynamo_program,
    export_dynamo,
    export_torchscript,
    exporter_cause,
    released_proto,
)
from tensorsmith.compiler.frontend.huggingface import HuggingFaceModel, build_empty_decoder, build_module, export_hint
from tensorsmith.compiler.frontend.layer_stamping import (
    MIN_LAYERS,
    TRACED_LAYERS,
    StampingRefused,
    check_alike,
    find_layer_stack,
    per_layer_variation,
    stamp_layers,
    truncated,
    weights_as_inputs,
)
from tensorsmith.compiler.frontend.source import Source
from tensorsmith.core.errors import ConfigError, ExportError
from tensorsmith.core.importing import first_line, import_factory

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Reference = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


@dataclass
class ExportedModel:
    model: onnx.ModelProto
    exporter: str  # "dynamo", "torchscript" or "none" (an ONNX source)
    fallback_reason: str | None = None
    # Computes the source model's outputs for feeds, to verify the compiled graph against (None for ONNX).
    reference: Reference | None = None
    warnings: list[str] = field(default_factory=list)  # torch's and onnx's, during the export (for the manifest)
    traced_layers: int | None = None  # a decoder's layers traced, the rest stamped from them (None: all traced)


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
    module: Any,
    config: CompileConfig,
    feeds: dict[str, np.ndarray],
    hint: str = FORWARD_HINT,
    scratch: Path | None = None,
) -> ExportedModel:
    output_names = config.outputs or None
    reference = _torch_reference(module, [decl.name for decl in config.inputs])
    failed: dict[str, Exception] = {}  # exporter → its error
    if config.exporter in ("auto", "dynamo"):
        warned: list[str] = []
        try:
            model = export_dynamo(module, config, feeds, output_names, warned, scratch)
            return ExportedModel(model, "dynamo", None, reference, warned)
        except Exception as err:  # the exporter raises many types; the reason goes into the manifest
            failed["dynamo"] = err
    if config.exporter in ("auto", "torchscript") and not _is_exported_program(module):
        warned = []
        try:
            model = export_torchscript(module, config, feeds, output_names, warned)
        except Exception as err:
            failed["torchscript"] = err
        else:
            dynamo = failed.get("dynamo")
            if dynamo is not None:
                logger.warning("the dynamo exporter failed (%s); exported with the TorchScript exporter instead",
                               exporter_cause(dynamo))  # fmt: skip
                logger.debug("the dynamo exporter's traceback", exc_info=dynamo)
            fallback = None if dynamo is None else f"dynamo: {exporter_cause(dynamo)}"
            return ExportedModel(model, "torchscript", fallback, reference, warned)
    for name, error in failed.items():  # -v: the exporters' own tracebacks (the ExportError's is tensorsmith's)
        logger.info("the %s exporter's traceback", name, exc_info=error)
    causes = "; ".join(f"{name}: {exporter_cause(error)}" for name, error in failed.items())
    raise ExportError(f"could not export {config.source} to ONNX: {causes}", hint=hint)


WeightTensor = Callable[[str], Any]  # a module's tensor name → the graph's tensor (onnx-ir) of its weight


def _module_tensors(module: torch.nn.Module) -> WeightTensor:
    """The module's own parameters and buffers as the stamped layers' weights: views of its memory, not copies."""
    import onnx_ir as ir

    tensors = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    return lambda name: ir.Tensor(tensors[name].detach().numpy(), name=name)


def _checkpoint_tensors(module: torch.nn.Module, weights: CheckpointWeights, names: dict[str, str]) -> WeightTensor:
    """The stamped layers' weights read from the checkpoint when written (a non-persistent buffer, which the
    checkpoint does not hold, from the module)."""
    own = _module_tensors(module)
    return lambda name: weights.lazy(names[name], name) if name in names else own(name)


def _stamping_refusal(module: torch.nn.Module, model: HuggingFaceModel, config: CompileConfig) -> str | None:
    """Why the decoder's layers are traced whole, or None where two are traced and the rest stamped."""
    if config.exporter == "torchscript" or config.trace_every_layer:
        return "asked for"
    layers = kv_layout(model.config)[0]
    reason = per_layer_variation(model.config, layers)
    if reason is None and layers < MIN_LAYERS:
        reason = f"{layers} layers"  # the whole trace costs little
    if reason is None and find_layer_stack(module, layers) is None:
        reason = "no module list of the layers"
    return reason


def _export_stamped(
    module: torch.nn.Module,
    model: HuggingFaceModel,
    config: CompileConfig,
    feeds: dict[str, np.ndarray],
    scratch: Path | None,
    weight_tensor: WeightTensor,
) -> ExportedModel | None:
    """A decoder traced with two layers and the rest stamped from the second (layer_stamping.py); None where the
    layers may differ or the trace of two fails, for the whole stack to be traced instead. `weight_tensor` gives
    every weight of the graph, the traced layers' included (the module's may be empty: checkpoint_weights.py)."""
    reason = _stamping_refusal(module, model, config)
    layers = kv_layout(model.config)[0]
    stack = find_layer_stack(module, layers)
    if reason is not None or stack is None:
        logger.info("tracing every layer: %s", reason)
        return None
    pasts, presents = past_names(layers), present_names(layers)
    trimmed = config.model_copy(update={
        "inputs": [decl for decl in config.inputs if decl.name not in pasts[2 * TRACED_LAYERS :]],
        "outputs": [name for name in config.outputs if name not in presents[2 * TRACED_LAYERS :]]})  # fmt: skip
    configs = list({id(m.config): m.config for m in module.modules()
                    if hasattr(getattr(m, "config", None), "num_hidden_layers")}.values())  # fmt: skip
    tensors = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    warned: list[str] = []
    try:
        with truncated(stack, configs):
            program = dynamo_program(module, trimmed, feeds, trimmed.outputs or None, warned, optimize=False)
        for name, value in program.model.graph.initializers.items():
            if name in tensors and tensors[name].is_floating_point():  # before the optimizer reads any weight
                value.const_value = weight_tensor(name)
        check_alike(program.model, stack)
        with weights_as_inputs(program.model, stack) as lifted:
            program.optimize()  # as the exporter optimizes a whole trace: the fusions match what its rewrites make
            known = set(tensors)
            stamp_layers(program.model, stack, lambda name: weight_tensor(name) if name in known else None, lifted,
                         pasts, presents)  # fmt: skip
    except StampingRefused as err:
        logger.info("tracing every layer: %s", err)
        return None
    except ExportError:
        raise  # a damaged checkpoint tensor, named
    except Exception as err:  # the exporter's errors of any type: the whole trace gives its own, for the user
        logger.info("tracing every layer: the trace of %d failed (%s)", TRACED_LAYERS, exporter_cause(err))
        logger.debug("the trace of two layers", exc_info=True)
        return None
    reference = _torch_reference(module, [decl.name for decl in config.inputs])
    try:
        exported = released_proto(program.model, scratch)  # the weights are read, checked and written here
    except Exception as err:  # onnx-ir wraps what a lazy weight raised in its SerdeError
        raise _named_cause(err) from err
    return ExportedModel(exported, "dynamo", None, reference, warned, traced_layers=TRACED_LAYERS)


def _named_cause(err: BaseException) -> BaseException:
    """The ExportError (a checkpoint tensor named) behind `err`, or `err` itself."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ExportError):
        cause = cause.__cause__ or cause.__context__
    return cause or err


def _export_decoder_from_checkpoint(
    model: HuggingFaceModel, config: CompileConfig, feeds: dict[str, np.ndarray], scratch: Path | None
) -> ExportedModel | None:
    """A decoder exported without loading its weights: an empty module traced with two layers, every weight of
    the graph read from the checkpoint as it is written, and a reference that reads one module's weights at a
    time (checkpoint_weights.py). None where the layers cannot be stamped or the module's tensors have other
    names in the checkpoint: the module is then loaded whole."""
    weights = CheckpointWeights(model.directory)
    try:
        module, names = build_empty_decoder(model, weights)
    except ExportError as err:
        logger.info("loading %s whole: %s", model.directory, err)
        return None
    exported = _export_stamped(module, model, config, feeds, scratch, _checkpoint_tensors(module, weights, names))
    if exported is None:
        return None
    run = _torch_reference(module, [decl.name for decl in config.inputs])

    def reference(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with weights_while_running(module, weights, names):
            return run(feeds)

    exported.reference = reference
    return exported


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


def factory_module(config: CompileConfig) -> torch.nn.Module:
    """A factory source's module, its checkpoint loaded and its forward() checked against the declared inputs."""
    module = _build_module(config)
    _check_forward_arguments(module, config.inputs)
    return module


def export_source(
    source: Source, feeds: dict[str, np.ndarray], scratch: Path | None = None, module: torch.nn.Module | None = None
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
        if source.is_decoder and not (config.exporter == "torchscript" or config.trace_every_layer):
            streamed = _export_decoder_from_checkpoint(source.huggingface, config, feeds, scratch)
            if streamed is not None:
                return streamed
        module = build_module(source.huggingface, [decl.name for decl in config.inputs])
        stamped = (_export_stamped(module, source.huggingface, config, feeds, scratch, _module_tensors(module))
                   if source.is_decoder else None)  # fmt: skip
        return stamped or _export_torch(module, config, feeds, export_hint(source.huggingface), scratch)
    if config.source_kind == "exported_program":
        program = _load_exported_program(config)
        exported = _export_torch(program, config, feeds, scratch=scratch)
        exported.reference = _torch_reference(program.module(), [decl.name for decl in config.inputs])
        return exported
    return _export_torch(module or factory_module(config), config, feeds, scratch=scratch)
