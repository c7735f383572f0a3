"""A decoder's KV cache made static: each step's keys and values written in place, not concatenated.

    past [B, kv, past, d] ─┐                          past [B, kv, cache, d] ─┐
    new  [B, kv, seq,  d] ─┴► Concat(axis 2) ─► present   new ────────────────┼► TensorScatter(axis -2) ─► present
                                                           write_indices [B] ─┘

The cache is as long as the request (`cache`: prompt and new tokens) from the first step; row b's `seq` new
entries land at slots write_indices[b] .. write_indices[b] + seq - 1, and present is past with them written, so a
backend that binds present to past's buffer (ONNX Runtime's I/O binding, TensorRT's aliased KV-cache update)
copies nothing. The mask the exporter built from `attention_mask [B, past + seq]` and the past's length becomes
one built from the slots: `attention_mask [B, cache]` (1 where the slot holds a real token, this step's
included), write_indices and the number of new tokens. Slot j is visible to the query in slot q when

    attention_mask[b, j] and j <= q (and j > q - window for a sliding-window layer), or j == q

(the query's own slot always, so that a left-padding query row is never fully masked: its softmax stays finite
and the keys it writes are never read by a real token, whose mask hides padding slots). Slot distance is
position distance for a row's real tokens, which are contiguous (prompts are left padded), so a window counts
the same as transformers' does. The rewrite needs the graph's attention as ONNX `Attention` nodes (passes/
attention.py) whose keys and values are the presents, or written out as Softmax(scores + mask) (latent attention,
passes/cache_graph.py; one window for every layer), whose mask operand it replaces; it refuses anything else,
naming what it found, and the compile then keeps the dynamic cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.errors import PassError
from tensorsmith.passes.base import PassReport
from tensorsmith.passes.cache_graph import (
    GraphDtype,
    StaticCacheDetails,
    cache_in_compute_dtype,
    dtype_name,
    masked_scores,
    new_token_columns,
    reads_batch_only,
    reads_no_length,
    replace_uses,
)
from tensorsmith.runtime.kv_cache import WRITE_INDICES, past_name, present_of

STATIC_CACHE_OPSET = 24  # TensorScatter's first
CACHE_DIM = "cache"
MASK = "attention_mask"


def _present_name(layer: int, kind: str) -> str:
    return present_of(past_name(layer, kind))


@dataclass
class StaticCache:
    """`windows[i]`: layer i's sliding window (None: it attends to every earlier slot). `capacity`: the cache's
    length as a fixed size (TensorRT's KV-cache update takes only a static sequence dim: "The KV cache tensor must
    have a static sequence length dimension"), else the dynamic dim `cache`, the request's length."""

    windows: Sequence[int | None]
    capacity: int | None = None
    name: str = "static_kv_cache"
    _constants: dict[str, gs.Constant] = field(default_factory=dict, repr=False)
    _additive: dict[tuple[str, str], gs.Variable] = field(default_factory=dict, repr=False)

    def __call__(self, graph: gs.Graph) -> PassReport:
        inputs = {tensor.name: tensor for tensor in graph.inputs}
        outputs = {tensor.name: tensor for tensor in graph.outputs}
        if MASK not in inputs or "input_ids" not in inputs:
            raise PassError("the graph has no attention_mask or input_ids input", hint="a decoder's KV-cache graph")
        write_indices = gs.Variable(WRITE_INDICES, np.dtype(np.int64), ["batch"])
        old_mask = inputs[MASK]
        layers = self._attention_layers(inputs)
        windows = [self.windows[layer] for layer in layers]
        attentions = [node for node in graph.nodes if node.op == "Attention"]
        explicit = [] if attentions else masked_scores(graph, old_mask, inputs["input_ids"])
        if not attentions and (not explicit or len(set(windows)) > 1):
            raise PassError(
                "the graph's attention is neither ONNX Attention nodes nor a Softmax over masked scores "
                "(with one window for every layer)",
                hint="the attention pass did not match (see the manifest's passes)",
            )
        for layer in layers:
            for kind in ("key", "value"):
                self._scatter(graph, inputs, outputs, layer, kind, write_indices)
        keys_of = {id(node.inputs[1]): node for node in attentions}
        slots = self._slots(graph, old_mask, inputs["input_ids"], write_indices)
        visible: dict[int | None, gs.Variable] = {}
        if explicit:  # every layer's scores: the one mask of the slots
            visible[windows[0]] = self._visible(graph, slots, windows[0])
        for add, operand in explicit:  # every reader of the scores' mask (DeepSeek-V3.2's indexer reads it too)
            old = add.inputs[operand]
            replace_uses(old, self._mask_like(graph, add.name, old, visible[windows[0]]))
        for slice_node in new_token_columns(old_mask, inputs["input_ids"]):  # linear attention's padding mask
            slice_node.inputs = [slots.mask, slots.columns]
            slice_node.op, slice_node.attrs = "GatherElements", {"axis": 1}
        for shape in [node for node in old_mask.outputs if reads_batch_only(node)]:  # the same batch either way
            shape.inputs[0] = slots.mask
        for layer, window in zip(layers if attentions else [], windows, strict=False):
            attention = keys_of.get(id(outputs[_present_name(layer, "key")]))
            if attention is None or attention.inputs[2] is not outputs[_present_name(layer, "value")]:
                raise PassError(
                    f"layer {layer}'s Attention does not read present.{layer}.key/value",
                    hint="the cache must feed Attention directly",
                )
            if window not in visible:
                visible[window] = self._visible(graph, slots, window)
            old = attention.inputs[3] if len(attention.inputs) > 3 else None
            attention.inputs[3] = self._mask_like(graph, attention.name, old, visible[window])
        # the exporter's mask (from the old attention_mask and the past's length) is dead now
        graph.inputs = [t for t in graph.inputs if t is not old_mask]
        graph.inputs.insert(graph.inputs.index(inputs["input_ids"]) + 1, slots.mask)
        graph.inputs.append(write_indices)
        graph.cleanup(remove_unused_graph_inputs=False)
        if old_mask.outputs:  # read by more than the masks replaced (BLOOM's ALiBi counts positions from it)
            readers = sorted({node.op for node in old_mask.outputs})
            raise PassError(
                f"{MASK} is read by {readers} besides the attention masks",
                hint="the graph derives more than its masks from the padding",
            )
        self._check_pasts_read_once(graph, layers)
        cache_dtype = dtype_name(inputs[past_name(layers[0], "key")].dtype)
        return PassReport(
            self.name,
            changed=True,
            counts={"layers": len(layers), "masks": len(visible), "state_layers": len(self.windows) - len(layers)},
            details=StaticCacheDetails(
                windows=sorted({w for w in self.windows if w is not None}),
                cache_dtype=cache_dtype,
                capacity=self.capacity or CACHE_DIM,
            ),
        )

    def _attention_layers(self, inputs: dict[str, gs.Tensor]) -> list[int]:
        """The layers with keys and values; the others (linear attention's) must have their fixed-size states,
        which stay as they are: present is the new state, of the past's shape."""
        layers = [layer for layer in range(len(self.windows)) if past_name(layer, "key") in inputs]
        for layer in sorted(set(range(len(self.windows))) - set(layers)):
            if not any(name.startswith(past_name(layer, "")) for name in inputs):
                raise PassError(
                    f"the graph has no {past_name(layer, 'key')} input nor a state of layer {layer}",
                    hint="config.json's layer count and the graph's cache disagree",
                )
        if not layers:
            raise PassError("the graph has no attention layer with keys and values", hint="a decoder with attention")
        return layers

    def _scatter(
        self,
        graph: gs.Graph,
        inputs: dict[str, gs.Tensor],
        outputs: dict[str, gs.Tensor],
        layer: int,
        kind: str,
        write_indices: gs.Variable,
    ) -> None:
        """present = TensorScatter(past, new, write_indices) in place of Concat(past, new)."""
        past, present = inputs.get(past_name(layer, kind)), outputs.get(_present_name(layer, kind))
        if past is None or present is None:
            raise PassError(
                f"the graph has no {past_name(layer, kind)} input or {_present_name(layer, kind)} output",
                hint="config.json's layer count and the graph's cache disagree",
            )
        cache_in_compute_dtype(past, present)
        concat = present.inputs[0] if present.inputs else None
        if concat is None or concat.op != "Concat" or concat.inputs[0] is not past or len(concat.inputs) != 2:
            found = concat.op if concat is not None else "a graph input"
            raise PassError(
                f"{present.name} is not Concat({past.name}, new) (found {found})",
                hint="a dynamic KV cache as the decoder export writes it",
            )
        if int(concat.attrs.get("axis", 0)) not in (2, -2):
            raise PassError(f"{present.name}'s Concat is on axis {concat.attrs.get('axis')}, not the sequence's")
        new = concat.inputs[1]
        concat.outputs.clear()
        batch, heads, _, head_dim = past.shape
        past.shape = present.shape = [batch, heads, self.capacity or CACHE_DIM, head_dim]
        scatter = gs.Node("TensorScatter", f"{present.name}/TensorScatter", {"axis": -2, "mode": "linear"})
        scatter.inputs, scatter.outputs = [past, new, write_indices], [present]
        graph.nodes.append(scatter)

    def _constant(self, name: str, value: np.ndarray) -> gs.Constant:
        if name not in self._constants:
            self._constants[name] = gs.Constant(f"static_cache/{name}", value)
        return self._constants[name]

    def _node(
        self,
        graph: gs.Graph,
        op: str,
        inputs: list[gs.Tensor],
        dtype: GraphDtype,
        name: str,
        attrs: dict[str, object] | None = None,
    ) -> gs.Variable:
        full_name = name if name.startswith("static_cache/") else f"static_cache/{name}"
        output = gs.Variable(full_name, dtype if isinstance(dtype, int) else np.dtype(dtype))
        graph.nodes.append(gs.Node(op, f"static_cache/{name}/{op}", attrs or {}, inputs, [output]))
        return output

    def _slots(
        self, graph: gs.Graph, old_mask: gs.Variable, input_ids: gs.Tensor, write_indices: gs.Variable
    ) -> _Slots:
        """Slot numbers [1, 1, cache], each query's slot [B, seq, 1] and the padding mask [B, 1, cache]."""
        mask = gs.Variable(MASK, np.dtype(np.int64), ["batch", self.capacity or CACHE_DIM])
        old_mask.name = f"{MASK}/dynamic"
        zero, one = self._constant("zero", np.array(0, np.int64)), self._constant("one", np.array(1, np.int64))
        cache_length = self._node(graph, "Shape", [mask], np.int64, "cache_length", {"start": 1, "end": 2})
        new_tokens = self._node(graph, "Shape", [input_ids], np.int64, "new_tokens", {"start": 1, "end": 2})
        cache_scalar = self._node(graph, "Squeeze", [cache_length], np.int64, "cache_scalar")
        new_scalar = self._node(graph, "Squeeze", [new_tokens], np.int64, "new_scalar")
        slot_range = self._node(graph, "Range", [zero, cache_scalar, one], np.int64, "slot_range")
        query_range = self._node(graph, "Range", [zero, new_scalar, one], np.int64, "query_range")
        axes01 = self._constant("axes01", np.array([0, 1], np.int64))
        key_slots = self._node(graph, "Unsqueeze", [slot_range, axes01], np.int64, "key_slots")  # [1, 1, C]
        axis1, axis2 = (
            self._constant("axes1", np.array([1], np.int64)),
            self._constant("axes2", np.array([2], np.int64)),
        )
        starts = self._node(graph, "Unsqueeze", [write_indices, axis1], np.int64, "starts")  # [B, 1]
        queries = self._node(graph, "Add", [starts, query_range], np.int64, "queries")  # [B, S]
        query_slots = self._node(graph, "Unsqueeze", [queries, axis2], np.int64, "query_slots")  # [B, S, 1]
        real = self._node(graph, "Cast", [mask], np.bool_, "real", {"to": 9})
        real_keys = self._node(graph, "Unsqueeze", [real, axis1], np.bool_, "real_keys")  # [B, 1, C]
        return _Slots(mask, key_slots, query_slots, real_keys, queries)

    def _visible(self, graph: gs.Graph, slots: _Slots, window: int | None) -> gs.Variable:
        """[B, 1, seq, cache] bool: which slots each query attends to."""
        tag = f"window{window}" if window else "full"
        earlier = self._node(graph, "LessOrEqual", [slots.keys, slots.queries], np.bool_, f"{tag}/causal")
        if window:
            lowest = self._node(
                graph,
                "Sub",
                [slots.queries, self._constant(f"w{window}", np.array(window, np.int64))],
                np.int64,
                f"{tag}/lowest",
            )
            inside = self._node(graph, "Greater", [slots.keys, lowest], np.bool_, f"{tag}/inside")
            earlier = self._node(graph, "And", [earlier, inside], np.bool_, f"{tag}/windowed")
        real = self._node(graph, "And", [earlier, slots.real], np.bool_, f"{tag}/real")
        own = self._node(graph, "Equal", [slots.keys, slots.queries], np.bool_, f"{tag}/own")
        either = self._node(graph, "Or", [real, own], np.bool_, f"{tag}/visible3")
        return self._node(
            graph, "Unsqueeze", [either, self._constant("axes1", np.array([1], np.int64))], np.bool_, f"{tag}/visible"
        )

    def _mask_like(self, graph: gs.Graph, reader: str, old: gs.Tensor | None, visible: gs.Variable) -> gs.Tensor:
        """`visible` as the mask `reader` had: boolean as it is, additive as Where(visible, 0, fill) with the old
        mask's own fill (a Where with constant branches), or 0/-10000 in the query's dtype."""
        if old is None:
            raise PassError(f"{reader} has no mask: the static cache needs one", hint="a causal decoder")
        if old.dtype == np.bool_:
            return visible
        producer = old.inputs[0] if old.inputs else None
        tag = dtype_name(old.dtype)
        key = (visible.name, tag)
        if key not in self._additive:
            if (
                producer is not None
                and producer.op == "Where"
                and all(isinstance(t, gs.Constant) for t in producer.inputs[1:])
            ):
                branches = list(producer.inputs[1:])  # the exporter's own 0 and fill, in the mask's dtype
            elif isinstance(old.dtype, int):
                raise PassError(f"{reader}'s mask is ONNX type {old.dtype} and not a Where of constants")
            else:
                dtype = np.dtype(old.dtype)
                branches = [
                    self._constant(f"zero_{tag}", np.array(0, dtype)),
                    self._constant(f"fill_{tag}", np.array(-10000, dtype)),
                ]
            self._additive[key] = self._node(
                graph, "Where", [visible, *branches], old.dtype, f"{visible.name}/additive_{tag}"
            )
        return self._additive[key]

    def _check_pasts_read_once(self, graph: gs.Graph, layers: list[int]) -> None:
        """Nothing but the update may read a past: anything else (its length, say) meant the old layout."""
        for layer in layers:
            for kind in ("key", "value"):
                past = next(t for t in graph.inputs if t.name == past_name(layer, kind))
                others = [node for node in past.outputs if node.op != "TensorScatter" and not reads_no_length(node)]
                if others:
                    raise PassError(
                        f"{past.name} is read by {[node.op for node in others]}, not only by its TensorScatter",
                        hint="the graph uses the cache's length; compile with --kv-cache dynamic",
                    )


@dataclass(frozen=True)
class _Slots:
    mask: gs.Variable
    keys: gs.Variable
    queries: gs.Variable
    real: gs.Variable
    columns: gs.Variable  # [B, S]: the new tokens' slots
