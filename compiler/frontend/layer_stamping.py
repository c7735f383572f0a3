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

Mixtures of experts stamp too: a mixture layer's If (compiler/frontend/routed_experts.py) reads the layer's
stacked experts inside its branches, from outside them, so a layer's weights and activations are found through
subgraphs (layer_graph.py), and the clones' branches read their own layer's experts. The pair count that chooses
the branch is computed once by the trace, in the first mixture layer, and shared with the next: it is not a
difference between them. Dense first layers (DeepSeek's `first_k_dense_replace`: 1 in V2-Lite, 3 in V3) are
traced as they are, with the two layers after them; the stamping starts from the second of those.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx_ir as ir
from onnx_ir._cloner import Cloner

from tensorsmith.compiler.frontend.config_json import ConfigJson
from tensorsmith.compiler.frontend.layer_graph import (
    NAME_SCOPES,
    depending_on,
    in_layer,
    layer_nodes,
    lent_to_next,
    reads,
    with_subgraphs,
)
from tensorsmith.core.checkpoint_references import REFERENCE_KEY

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

TRACED_LAYERS = 2  # layer 0 (it may differ: it reads the embeddings) and layer 1, the template for the rest
MIN_LAYERS = 4  # below this the trace of the whole stack costs little
LEADING_KEY = "first_k_dense_replace"  # config.json's count of dense layers before the mixture-of-experts ones
# config.json keys that make some layers differ from others (MoE every k layers, dense first layers, …)
PER_LAYER_KEYS = (
    "mlp_only_layers",
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
    lead: int = 0  # layers before the repeated kind (DeepSeek's dense first layers), traced as they are

    @property
    def template(self) -> int:
        """The layer the rest are stamped from: the second of the repeated kind (the first may differ, reading
        what the lead layers or the embeddings hand on)."""
        return self.lead + 1

    @property
    def traced(self) -> int:
        return self.lead + TRACED_LAYERS


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


def leading_layers(config: ConfigJson) -> int:
    """The dense layers config.json puts before the mixture-of-experts ones (DeepSeek's first_k_dense_replace):
    traced as they are, the stamping starting after them."""
    value = config.get(LEADING_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@contextlib.contextmanager
def truncated(stack: LayerStack, configs: list[PretrainedConfig]) -> Iterator[None]:
    """The module with only its first `stack.traced` layers (and its configs saying so), for the trace; restored
    after."""
    import torch

    keep = stack.traced
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


def check_alike(model: ir.Model, stack: LayerStack) -> None:
    """The template layer and the one before it (layers 0 and 1 without lead layers) of the (unoptimized) trace
    are the same ops, but for what the first computes once for both from no weight of its own (a mixture of
    experts' pair count), or the layers are not stamped."""
    before, template = stack.template - 1, stack.template
    first, second = ([node for node in model.graph if in_layer(node, f"{stack.path}.{i}")] for i in (before, template))
    lent = lent_to_next(first, second, f"{stack.path}.{before}.")
    if not second or _ops([node for node in first if id(node) not in lent]) != _ops(second):
        raise StampingRefused(f"layers {before} and {template} trace to different ops")


def _ops(nodes: list[ir.Node]) -> list[str]:
    """The ops in order, their subgraphs' (an If's branches) included, but for Constants: the exporter makes each
    constant once, in the first layer to use it."""
    return [member.op_type for node in nodes for member in with_subgraphs(node) if member.op_type != "Constant"]


def _renamed_scopes(text: str, stack: str, template: int, layer: int) -> str:
    return re.sub(rf"{re.escape(stack)}\.{template}(?=[.'\]])", f"{stack}.{layer}", text)


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
    module's names through the exporter's optimizer, and it can run on the traced layers, not all of them. A weight
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
    """Grow `model`, traced with `stack.traced` layers and its weights lifted by `weights_as_inputs`, to
    `stack.count` layers in place.

    `weight_tensor`: a weight's tensor by its name in the trace (the module's parameter or buffer name), None
    for a name the module does not have; the new layers' weights are added to `lifted`; `past_names` and
    `present_names`: the graph inputs and outputs of every layer, two a layer, in order."""
    graph = model.graph
    index = stack.template
    template, first = layer_nodes(graph, f"{stack.path}.{index}"), layer_nodes(graph, f"{stack.path}.{index - 1}")
    if not template:
        raise StampingRefused(f"no node of the trace is in {stack.path}.{index}")
    inside = {id(member) for node in template for member in with_subgraphs(node)}
    from_first_weights = depending_on(first, f"{stack.path}.{index - 1}.")
    inputs = {value.name: value for value in graph.inputs}
    outputs = {value.name: value for value in graph.outputs}
    weight_prefix = f"{stack.path}.{index}."

    carried_in: list[ir.Value] = []
    weights: list[ir.Value] = []
    for node in template:
        for value in reads(node):  # an If's branches read the layer's experts from outside them
            if value in carried_in or value in weights:
                continue
            if value.is_graph_input() and value.name and value.name.startswith(weight_prefix):
                weights.append(value)  # lifted by `weights_as_inputs`
            elif id(value) in from_first_weights:
                carried_in.append(value)  # layer 0's activation (the optimizer shares layer 0's shape arithmetic)
    from_template_weights = depending_on(template, weight_prefix)
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
        raise StampingRefused(f"layer {index} takes {counts} activations, not one")
    past = [inputs.get(name) for name in past_names[2 * index : 2 * index + 2]]
    present = [outputs.get(name) for name in present_names[2 * index : 2 * index + 2]]
    if None in past or None in present:
        raise StampingRefused(f"layer {index}'s past or present is not a graph input or output")

    after = [(user, index) for user, index in carried_out[0].uses() if id(user) not in inside]  # the final norm
    previous, anchor = carried_out[0], template[-1]
    for layer in range(stack.traced, stack.count):
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
                scopes = node.metadata_props[NAME_SCOPES]
                node.metadata_props[NAME_SCOPES] = _renamed_scopes(scopes, stack.path, index, layer)
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
    for user, position in after:  # what came after the template reads the last layer's activation
        user.replace_input_with(position, previous)
    logger.info("traced %d of %d layers; stamped the rest from %s.%d", stack.traced, stack.count, stack.path, index)
