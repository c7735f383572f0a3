"""Export a decoder by tracing two of its layers and repeating the second's graph for the rest.

Tracing is per op: torch.export and the ONNX translation cost about the same for every decoder layer, and a
30-layer decoder of SmolLM-135M's shape spent 62 s there, nearly all of it on layers whose graphs are the same
but for their weights. So the layer stack is cut to two for the trace (layer 0 can differ from the rest:
it reads the embeddings), then layer 1's nodes are cloned once per further layer with onnx-ir, each clone reading
its own layer's weights (the full module's own tensors, not copies), past and present, and the one activation
carried from the layer before. Module paths in the node metadata are rewritten to the clone's layer, so precision
plans and reports name layers as if each had been traced.

It is used only where the layers are the same by construction: config.json gives no per-layer variation
(`layer_types` all alike, no per-layer lists), layer 0 and layer 1 trace to the same ops, and layer 1 hands on a
single activation. Anything else is traced whole. The compile's verification runs the stamped graph against the
full transformers model, so a difference the checks miss still fails loudly.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx_ir as ir
from onnx_ir._cloner import Cloner

from tensorsmith.compiler.frontend.config_json import ConfigJson
from tensorsmith.core.checkpoint_references import REFERENCE_KEY

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

TRACED_LAYERS = 2  # layer 0 (it may differ: it reads the embeddings) and layer 1, the template for the rest
MIN_LAYERS = 4  # below this the trace of the whole stack costs little
NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # the dynamo exporter's module path of each node
# config.json keys that make some layers differ from others (MoE every k layers, dense first layers, …)
PER_LAYER_KEYS = (
    "mlp_only_layers",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "moe_layer_freq",
    "interleave_moe_layer_step",
    "no_rope_layers",
    "sliding_window_pattern",
    "cross_attention_layers",
    "full_attn_idxs",
)


class StampingRefused(Exception):
    """The layers cannot be stamped (they differ, or the graph is not the expected shape): trace them all."""


@dataclass(frozen=True)
class LayerStack:
    """The decoder's layers: the nn.ModuleList at `path` (its module path in the exported module)."""

    path: str
    count: int
    parent: torch.nn.Module  # the module holding the list
    attribute: str


def find_layer_stack(module: torch.nn.Module, count: int) -> LayerStack | None:
    """The outermost nn.ModuleList of `count` modules (the decoder layers; an MoE's experts lie inside them)."""
    import torch

    for path, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) == count and path:
            parent_path, _, attribute = path.rpartition(".")
            return LayerStack(path, count, module.get_submodule(parent_path), attribute)
    return None


def per_layer_variation(config: ConfigJson, count: int) -> str | None:
    """Why config.json says the layers differ, or None when it says nothing of the kind."""
    for key, value in config.items():
        if isinstance(value, list) and len(value) == count and len({repr(item) for item in value}) > 1:
            return f"config.json's {key} differs between layers"
    for key in PER_LAYER_KEYS:
        if config.get(key) not in (None, [], 0, 1, False):
            return f"config.json gives {key}"
    if config.get("use_sliding_window") and config.get("max_window_layers") not in (None, 0, count):
        return "config.json's max_window_layers makes some layers sliding-window"
    return None


@contextlib.contextmanager
def truncated(stack: LayerStack, configs: list[PretrainedConfig], keep: int = TRACED_LAYERS) -> Iterator[None]:
    """The module with only its first `keep` layers (and its configs saying so), for the trace; restored after."""
    import torch

    layers = getattr(stack.parent, stack.attribute)
    counts = [config.num_hidden_layers for config in configs]
    setattr(stack.parent, stack.attribute, torch.nn.ModuleList(list(layers)[:keep]))
    for config in configs:
        config.num_hidden_layers = keep
    try:
        yield
    finally:
        setattr(stack.parent, stack.attribute, layers)
        for config, count in zip(configs, counts, strict=True):
            config.num_hidden_layers = count


def _scopes(node: ir.Node) -> list[str]:
    text = node.metadata_props.get(NAME_SCOPES, "")
    try:
        return [str(scope) for scope in ast.literal_eval(text)] if text else []
    except (ValueError, SyntaxError):
        return []


def _in_layer(node: ir.Node, layer_path: str) -> bool:
    return layer_path in _scopes(node)


def _layer_nodes(graph: ir.Graph, layer_path: str) -> list[ir.Node]:
    """The nodes of the layer at `layer_path`, in order: those its module made, and those the optimizer made
    without a module path (a Split for a layer's Slices) from their values."""
    members: list[ir.Node] = []
    produced: set[int] = set()
    for node in graph:
        unscoped = NAME_SCOPES not in node.metadata_props
        if _in_layer(node, layer_path) or (unscoped and any(id(v) in produced for v in node.inputs if v)):
            members.append(node)
            produced.update(id(output) for output in node.outputs)
    return members


def check_alike(model: ir.Model, stack: LayerStack) -> None:
    """Layers 0 and 1 of the (unoptimized) trace are the same ops, or the layers are not stamped."""
    first, second = ([node for node in model.graph if _in_layer(node, f"{stack.path}.{i}")] for i in (0, 1))
    if not second or _ops(first) != _ops(second):
        raise StampingRefused("layers 0 and 1 trace to different ops")


def _depending_on(nodes: list[ir.Node], weight_prefix: str) -> set[int]:
    """ids of the values `nodes` (in order) compute from a weight named with `weight_prefix`."""
    found: set[int] = set()
    for node in nodes:
        if any(
            value is not None
            and (id(value) in found or (value.is_graph_input() and str(value.name).startswith(weight_prefix)))
            for value in node.inputs
        ):
            found.update(id(output) for output in node.outputs)
    return found


def _ops(nodes: list[ir.Node]) -> list[str]:
    """The ops in order, but for Constants: the exporter makes each constant once, in the first layer to use it."""
    return [node.op_type for node in nodes if node.op_type != "Constant"]


def _renamed_scopes(text: str, stack: str, layer: int) -> str:
    return re.sub(rf"{re.escape(stack)}\.1(?=[.'\]])", f"{stack}.{layer}", text)


def _input_like(graph: ir.Graph, old: ir.Value, name: str) -> ir.Value:
    """A new graph input of `old`'s type and shape, named `name` (a later layer's past, or its lifted weight)."""
    new = ir.Value(name=name, type=old.type, shape=old.shape.copy() if old.shape else None)
    graph.inputs.append(new)
    return new


@contextlib.contextmanager
def weights_as_inputs(model: ir.Model, stack: LayerStack) -> Iterator[dict[str, ir.TensorProtocol]]:
    """The layers' weights as graph inputs while inside, initializers again after (those `stamp_layers` adds
    too). As inputs the optimizer can neither fold them into new, unnamed tensors (a Linear's transposed weight)
    nor merge equal ones across layers (norm weights that start as ones), so each layer's weights keep their
    module's names through the exporter's optimizer, and it can run on two layers instead of all of them. A weight
    kept in the checkpoint's files (core/checkpoint_references.py) is lifted too, wherever it is: the optimizer would
    fold the output projection's Transpose into a new float32 tensor (2.1 GB written at 8B)."""
    graph = model.graph
    lifted: dict[str, ir.TensorProtocol] = {}
    referred = {
        name
        for name, value in graph.initializers.items()
        if value.const_value is not None and REFERENCE_KEY in value.const_value.meta
    }
    for name in [name for name in graph.initializers if name.startswith(f"{stack.path}.") or name in referred]:
        value = graph.initializers.pop(name)
        assert value.const_value is not None
        lifted[name], value.const_value = value.const_value, None
        graph.inputs.append(value)
    yield lifted
    for value in [value for value in graph.inputs if value.name in lifted]:
        graph.inputs.remove(value)
        value.const_value = lifted[str(value.name)]
        graph.register_initializer(value)


def stamp_layers(
    model: ir.Model,
    stack: LayerStack,
    weight_tensor: Callable[[str], ir.TensorProtocol | None],
    lifted: dict[str, ir.TensorProtocol],
    past_names: list[str],
    present_names: list[str],
) -> None:
    """Grow `model`, traced with TRACED_LAYERS layers and its weights lifted by `weights_as_inputs`, to
    `stack.count` layers in place.

    `weight_tensor`: a weight's tensor by its name in the trace (the module's parameter or buffer name), None
    for a name the module does not have; the new layers' weights are added to `lifted`; `past_names` and
    `present_names`: the graph inputs and outputs of every layer, two a layer, in order."""
    graph = model.graph
    template, first = _layer_nodes(graph, f"{stack.path}.1"), _layer_nodes(graph, f"{stack.path}.0")
    if not template:
        raise StampingRefused(f"no node of the trace is in {stack.path}.1")
    inside = {id(node) for node in template}
    from_first_weights = _depending_on(first, f"{stack.path}.0.")
    inputs = {value.name: value for value in graph.inputs}
    outputs = {value.name: value for value in graph.outputs}
    weight_prefix = f"{stack.path}.1."

    carried_in: list[ir.Value] = []
    weights: list[ir.Value] = []
    for node in template:
        for value in node.inputs:
            if value is None or value in carried_in or value in weights:
                continue
            if value.is_graph_input() and value.name and value.name.startswith(weight_prefix):
                weights.append(value)  # lifted by `weights_as_inputs`
            elif id(value) in from_first_weights:
                carried_in.append(value)  # layer 0's activation (the optimizer shares layer 0's shape arithmetic)
    from_template_weights = _depending_on(template, weight_prefix)
    carried_out = [
        value
        for node in template
        for value in node.outputs
        if not value.is_graph_output()
        and id(value) in from_template_weights
        and any(id(user) not in inside for user, _ in value.uses())
    ]
    if len(carried_in) != 1 or len(carried_out) != 1:
        counts = f"{len(carried_in)} and hands on {len(carried_out)}"
        raise StampingRefused(f"layer 1 takes {counts} activations, not one")
    past = [inputs.get(name) for name in past_names[2:4]]
    present = [outputs.get(name) for name in present_names[2:4]]
    if None in past or None in present:
        raise StampingRefused("layer 1's past or present is not a graph input or output")

    after = [(user, index) for user, index in carried_out[0].uses() if id(user) not in inside]  # the final norm
    previous, anchor = carried_out[0], template[-1]
    for layer in range(TRACED_LAYERS, stack.count):
        value_map: dict[ir.Value, ir.Value | None] = {carried_in[0]: previous}
        for old, name in zip(past, past_names[2 * layer : 2 * layer + 2], strict=True):
            assert old is not None
            value_map[old] = _input_like(graph, old, name)
        for old in weights:
            assert old.name is not None
            name = f"{stack.path}.{layer}.{old.name[len(weight_prefix) :]}"
            tensor = weight_tensor(name)
            if tensor is None:
                raise StampingRefused(f"the module has no {name}")
            lifted[name] = tensor
            value_map[old] = _input_like(graph, old, name)
        suffix = f"__layer{layer}"

        def rename(node: ir.Node, layer: int = layer, suffix: str = suffix) -> None:
            node.name = f"{node.name}{suffix}" if node.name else None
            if NAME_SCOPES in node.metadata_props:
                node.metadata_props[NAME_SCOPES] = _renamed_scopes(node.metadata_props[NAME_SCOPES], stack.path, layer)
            for output in node.outputs:
                output.name = f"{output.name}{suffix}"

        cloner = Cloner(
            attr_map={}, value_map=value_map, metadata_props={}, post_process=rename, allow_outer_scope_values=True
        )
        clones = [cloner.clone_node(node) for node in template]
        graph.insert_after(anchor, clones)
        for old, name in zip(present, present_names[2 * layer : 2 * layer + 2], strict=True):
            new_present = value_map[old]  # type: ignore[index]
            assert new_present is not None
            new_present.name = name
            graph.outputs.append(new_present)
        handed_on = value_map[carried_out[0]]
        assert handed_on is not None
        previous, anchor = handed_on, clones[-1]
    for user, index in after:  # what came after layer 1 reads the last layer's activation
        user.replace_input_with(index, previous)
    logger.info("traced %d of %d layers; stamped the rest from %s.1", TRACED_LAYERS, stack.count, stack.path)
