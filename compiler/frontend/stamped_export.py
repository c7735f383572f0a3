"""A decoder's export as two traced layers and the rest stamped from the second (layer_stamping.py), its weights
either the loaded module's or read from the checkpoint one tensor at a time (checkpoint_weights.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.compiler.frontend.decoder import kv_cache_module, kv_layout, past_names, present_names
from tensorsmith.compiler.frontend.exported import ExportedModel, torch_reference
from tensorsmith.compiler.frontend.exporters import EXPORTED_NAME, dynamo_program, exporter_cause, released_proto
from tensorsmith.compiler.frontend.huggingface import build_module, class_config, experts_option, model_class
from tensorsmith.compiler.frontend.layer_stamping import (
    MIN_LAYERS,
    StampingRefused,
    check_alike,
    find_layer_stack,
    leading_layers,
    per_layer_variation,
    stamp_layers,
    truncated,
    weights_as_inputs,
)
from tensorsmith.compiler.frontend.model_directory import HuggingFaceModel
from tensorsmith.compiler.frontend.module_weights import (
    checkpoint_names,
    converts_keys,
    empty_parameters,
    load_buffers,
    parameters_on_meta,
    release_parameters,
    weights_while_running,
)
from tensorsmith.core.checkpoint_references import can_link
from tensorsmith.core.errors import ExportError
from tensorsmith.core.importing import first_line
from tensorsmith.core.layerwise import runs_layerwise
from tensorsmith.core.progress import Reporter

if TYPE_CHECKING:
    import onnx_ir as ir
    import torch
    from transformers import PreTrainedModel

logger = logging.getLogger("tensorsmith.compiler.frontend.export")  # one logger for the export, as before


def build_empty_decoder(
    model: HuggingFaceModel, weights: CheckpointWeights, mla_cache: str = "latent"
) -> tuple[torch.nn.Module, dict[str, str]]:
    """The decoder's module with no weight loaded (checkpoint_weights.py): its parameters are float32 tensors
    never written, the checkpoint's persistent buffers loaded; with each tensor's name in the checkpoint by its
    name in the module. An ExportError where some parameter has no name in the checkpoint (transformers renames
    that family's keys as it loads them): the caller loads the module whole instead."""
    loaded, names = _meta_decoder(model, weights)
    try:
        empty_parameters(loaded)  # address space only, but a strict overcommit policy may refuse it
        load_buffers(loaded, weights, names)
    except (RuntimeError, MemoryError) as err:
        raise ExportError(f"{model.directory}: the empty module could not be made ({first_line(err)})") from err
    module = kv_cache_module(loaded.eval(), mla_cache)
    return module, {f"model.{name}": key for name, key in names.items()}  # kv_cache_module holds it as `model`


def _meta_decoder(model: HuggingFaceModel, weights: CheckpointWeights) -> tuple[PreTrainedModel, dict[str, str]]:
    """The decoder built on the meta device (nothing allocated) and each parameter's name in the checkpoint; an
    ExportError where transformers cannot build it, or converts or renames tensors as it loads them (a mixture's
    experts stacked from one tensor each): such a module is loaded whole."""
    import torch

    cls = model_class(model)
    try:
        config = class_config(model, cls)
        with parameters_on_meta():
            loaded = cls._from_config(config, dtype=torch.float32, attn_implementation="eager", **experts_option())
    except Exception as err:  # transformers raises many types for a config it cannot build
        raise ExportError(f"transformers could not build {model.directory}: {first_line(err)}") from err
    names = checkpoint_names(loaded, weights)
    if names is None or converts_keys(loaded):
        raise ExportError(
            f"{model.directory}: transformers renames or converts some of {model.architecture}'s "
            "tensors as it loads them"
        )
    return loaded, names


WeightTensor = Callable[[str], "ir.TensorProtocol"]  # a module's tensor name → the graph's tensor of its weight


def module_tensors(module: torch.nn.Module) -> WeightTensor:
    """The module's own parameters and buffers as the stamped layers' weights: views of its memory, not copies."""
    import onnx_ir as ir

    tensors = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    return lambda name: ir.Tensor(tensors[name].detach().numpy(), name=name)


def _checkpoint_tensors(
    module: torch.nn.Module, weights: CheckpointWeights, names: dict[str, str], referable: bool
) -> WeightTensor:
    """The stamped layers' weights read from the checkpoint when written (a non-persistent buffer, which the
    checkpoint does not hold, from the module); `referable`: stored as references to the checkpoint's bytes."""
    own = module_tensors(module)
    return lambda name: weights.lazy(names[name], name, referable) if name in names else own(name)


def _refers(weights: CheckpointWeights, scratch: Path | None) -> bool:
    """Whether the graph keeps its weights in the checkpoint's files (core/checkpoint_references.py): where it will
    be run a layer at a time (its fp32 weights large against the memory), and the files can be linked beside it."""
    if scratch is None or not runs_layerwise(4 * weights.float_parameters()):
        return False
    return all(can_link(scratch / EXPORTED_NAME, file) for file in weights.files())


def _stamping_refusal(model: HuggingFaceModel, config: CompileConfig) -> str | None:
    """Why config.json or the compile's options have the decoder's layers traced whole, or None (the trace may
    still find them unlike: export_stamped)."""
    if config.exporter == "torchscript" or config.trace_every_layer:
        return "asked for"
    layers = kv_layout(model.config).layers
    reason = per_layer_variation(model.config, layers)
    if reason is None and layers < leading_layers(model.config) + MIN_LAYERS:
        reason = f"{layers} layers"  # the whole trace costs little
    return reason


def export_stamped(
    module: torch.nn.Module,
    model: HuggingFaceModel,
    config: CompileConfig,
    feeds: dict[str, np.ndarray],
    scratch: Path | None,
    weight_tensor: WeightTensor,
) -> ExportedModel | None:
    """A decoder traced with its lead layers and two more, the rest stamped from the last (layer_stamping.py); None
    where the layers may differ or that trace fails, for the whole stack to be traced instead. `weight_tensor` gives
    every weight of the graph, the traced layers' included (the module's may be empty: checkpoint_weights.py)."""
    reason = _stamping_refusal(model, config)
    layout = kv_layout(model.config)
    layers = layout.layers
    found = find_layer_stack(module, layers) if reason is None else None
    if reason is not None or found is None:
        logger.info("tracing every layer: %s", reason or "no module list of the layers")
        return None
    stack = dataclasses.replace(found, lead=leading_layers(model.config))
    pasts, presents = past_names(layout), present_names(layout)
    trimmed = config.model_copy(
        update={
            "inputs": [decl for decl in config.inputs if decl.name not in pasts[2 * stack.traced :]],
            "outputs": [name for name in config.outputs if name not in presents[2 * stack.traced :]],
        }
    )
    held = (getattr(m, "config", None) for m in module.modules())  # transformers' configs, the model's and its parts'
    configs = list({id(c): c for c in held if c is not None and hasattr(c, "num_hidden_layers")}.values())
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
            stamp_layers(
                program.model,
                stack,
                lambda name: weight_tensor(name) if name in known else None,
                lifted,
                pasts,
                presents,
            )
    except StampingRefused as err:
        logger.info("tracing every layer: %s", err)
        return None
    except ExportError:
        raise  # a damaged checkpoint tensor, named
    except Exception as err:  # the exporter's errors of any type: the whole trace gives its own, for the user
        logger.info("tracing every layer: the trace of %d failed (%s)", stack.traced, exporter_cause(err))
        logger.debug("the trace of %d layers", stack.traced, exc_info=True)
        return None
    reference = torch_reference(module, [decl.name for decl in config.inputs])
    try:
        exported = released_proto(program.model, scratch)  # the weights are read, checked and written here
    except Exception as err:  # onnx-ir wraps what a lazy weight raised in its SerdeError
        cause = _named_cause(err)
        if cause is err:
            raise
        raise cause from err
    return ExportedModel(exported, "dynamo", None, reference, warned, traced_layers=stack.traced)


def _named_cause(err: BaseException) -> BaseException:
    """The ExportError (a checkpoint tensor named) behind `err`, or `err` itself."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ExportError):
        cause = cause.__cause__ or cause.__context__
    return cause or err


def may_stream_weights(model: HuggingFaceModel, config: CompileConfig) -> bool:
    """Whether the export tries to read `model`'s weights from its checkpoint: a decoder whose config.json says its
    layers are alike (export_decoder_from_checkpoint then finds whether its tensors are read as stored)."""
    return model.is_decoder and _stamping_refusal(model, config) is None


def streams_weights(model: HuggingFaceModel, config: CompileConfig) -> bool:
    """Whether the export will read `model`'s weights from its checkpoint (no float32 module), for the estimate
    before any work: `may_stream_weights`, and transformers reads its tensors as stored (a meta-device build, as
    the export's first step makes it; the trace may still refuse)."""
    if not may_stream_weights(model, config):
        return False
    try:
        _meta_decoder(model, model.checkpoint_weights())
    except ExportError:
        return False  # loaded whole: its float32 module counted in the estimate
    return True


def export_decoder_from_checkpoint(
    model: HuggingFaceModel,
    config: CompileConfig,
    feeds: dict[str, np.ndarray],
    scratch: Path | None,
    reporter: Reporter,
) -> ExportedModel | None:
    """A decoder exported without loading its weights: an empty module traced with a few layers, every weight of
    the graph read from the checkpoint as it is written, and a reference that reads one module's weights at a
    time (checkpoint_weights.py); each shown as a counted task. None where the layers cannot be stamped or the
    module's tensors have other names in the checkpoint: the module is then loaded whole."""
    weights = model.checkpoint_weights()
    try:
        module, names = build_empty_decoder(model, weights, config.mla_cache)
    except ExportError as err:
        logger.info("loading %s whole: %s", model.directory, err)
        return None
    read = len(set(names.values()))  # the tensors the module reads (a checkpoint may hold others)
    with _counted(reporter, "writing the checkpoint's weights into the graph", weights, read):
        tensors = _checkpoint_tensors(module, weights, names, _refers(weights, scratch))
        exported = export_stamped(module, model, config, feeds, scratch, tensors)
    if exported is None:
        return None
    release_parameters(module)  # traced: from here a weight is read only inside its module's forward
    inputs = [decl.name for decl in config.inputs]
    run = torch_reference(module, inputs)

    def reference(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        shown = _counted(reporter, "the source's outputs, one module's weights at a time", weights, read)
        try:
            with shown, weights_while_running(module, weights, names):
                return run(feeds)
        except RuntimeError as err:  # a weight read outside its module's forward: released, so it fails loudly
            logger.info("the source's outputs from the whole module: %s", first_line(err))
            return torch_reference(build_module(model, inputs, config.mla_cache), inputs)(feeds)

    exported.reference = reference
    return exported


@contextlib.contextmanager
def _counted(reporter: Reporter, description: str, weights: CheckpointWeights, total: int) -> Iterator[None]:
    """`weights`' reads while inside, as a task of `total` steps."""
    done = 0

    def read() -> None:  # a tied or folded weight is read twice: the count stops at the total
        nonlocal done
        if done < total:
            done += 1
            advance(1)

    with reporter.task(description, total) as advance:
        weights.on_read = read
        try:
            yield
        finally:
            weights.on_read = lambda: None
