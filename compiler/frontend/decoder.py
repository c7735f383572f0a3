"""Decoders (`*ForCausalLM`) with a KV cache: one graph for prefill (past length 0) and decode (one new token).

The graph's inputs and outputs are those Optimum and ONNX Runtime GenAI use:

    input_ids [batch, sequence], attention_mask [batch, total], position_ids [batch, sequence],
    past_key_values.N.key|value [batch, kv_heads, past, head_dim]
    → logits [batch, sequence, vocab], present.N.key|value [batch, kv_heads, total, head_dim]

with total = past + sequence. transformers 5 keeps the cache in a `DynamicCache` of layers; the wrapper fills
one from the flat past tensors, with plain `DynamicLayer`s (not the sliding-window ones `DynamicCache(config=…)`
makes, which crop the cache): a sliding window is applied by the mask the model builds from its config, so the
presents are always past + sequence long and a window is honoured past its length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from tensorsmith.compiler.config import CompileConfig, DimRange, InputDecl
from tensorsmith.compiler.frontend.architecture_checks import STATE_LAYER_KINDS
from tensorsmith.compiler.frontend.complex_rotary import real_rotation_while_tracing, rewrite_complex_rotary
from tensorsmith.compiler.frontend.config_json import ConfigJson
from tensorsmith.compiler.frontend.latent_attention import latent_cache_widths, rewrite_latent_attention
from tensorsmith.compiler.frontend.layer_states import LayerStates, layer_states
from tensorsmith.compiler.frontend.linear_attention import (
    StateLayer,
    rewrite_linear_attention,
    token_masks_while_tracing,
)
from tensorsmith.compiler.frontend.module_protocols import CachedKeysValues
from tensorsmith.compiler.frontend.short_convolution import rewrite_short_convolution
from tensorsmith.compiler.targets import get_target
from tensorsmith.core.ir import GraphIO
from tensorsmith.core.precisions import float_regions
from tensorsmith.passes.static_cache import CACHE_DIM
from tensorsmith.runtime.kv_cache import WRITE_INDICES, past_name, present_of
from tensorsmith.runtime.manifest import GenerationRecord, TensorRecord

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from tensorsmith.compiler.frontend.model_directory import HuggingFaceModel

DECODER_OPSET = 23  # the first with RMSNormalization
MAX_BATCH = 8  # the default [dims.batch] max of a decoder (engines: at most the target's max_batch)
# total = past + sequence: example feeds (export, verification) keep the mask as long as the cache plus the tokens.
DIM_SUMS = {"total": ["past", "sequence"]}


@dataclass(frozen=True)
class KVLayout:
    """What a decoder caches per layer: `kv_heads` heads of keys `key_dim` wide and values `value_dim` wide."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    form: str = "per_head"  # GenerationRecord.cache_form
    states: LayerStates | None = None  # layers with fixed-size states in place of keys and values
    layer_head_dims: Mapping[int, int] = field(default_factory=dict)  # layers of another width (Gemma 4's global)

    def last_dim(self, kind: str, layer: int | None = None) -> int:
        if layer is not None and layer in self.layer_head_dims:
            return self.layer_head_dims[layer]
        return self.key_dim if kind == "key" else self.value_dim

    def layer_tensors(self, layer: int) -> tuple[str, ...]:
        return tuple(self.states.shapes) if self.states and layer in self.states.layers else ("key", "value")

    def dims(self, kind: str, layer: int | None = None) -> list[str | int]:
        """A past's dims: [batch, kv_heads, past, last dim], or a state's [batch, *its fixed shape]."""
        if self.states is not None and kind in self.states.shapes:
            return ["batch", *self.states.shapes[kind]]
        return ["batch", self.kv_heads, "past", self.last_dim(kind, layer)]


def kv_layout(config: ConfigJson, mla_cache: str = "latent") -> KVLayout:
    """The cache layout from config.json, for the families' own key names. Multi-head latent attention
    (`kv_lora_rank`: DeepSeek-V2/V3) caches its normalised latent and its rotary key, one head each, as
    transformers does (compiler/frontend/latent_attention.py); `mla_cache="full"` caches every head's keys
    (qk_nope + qk_rope wide) and values (v_head_dim)."""
    layers = config.get("num_hidden_layers") or config.get("n_layer")
    heads = config.get("num_attention_heads") or config.get("n_head")
    hidden = config.get("hidden_size") or config.get("n_embd")
    if not (layers and heads and hidden):
        raise ValueError("config.json gives no num_hidden_layers/num_attention_heads/hidden_size (or n_layer, …)")
    if config.get("kv_lora_rank"):
        return KVLayout(int(layers), *latent_cache_widths(config, mla_cache))
    kv_heads = config.get("num_key_value_heads") or heads
    # Falcon's and GPTBigCode's multi-query attention caches one key and value head; Falcon's new decoder
    # architecture (its num_kv_heads) broadcasts them to every head before the cache, which so holds them all.
    if config.get("multi_query") and not config.get("new_decoder_architecture"):
        kv_heads = 1
    head_dim = int(config.get("head_dim") or hidden // heads)
    return KVLayout(
        int(layers),
        int(kv_heads),
        head_dim,
        head_dim,
        states=layer_states(config),
        layer_head_dims=_layer_head_dims(config),
    )


def _layer_head_dims(config: ConfigJson) -> dict[int, int]:
    """The layers whose head size config.json's `per_layer_config` sets (Gemma 4's global layers: 512)."""
    dims = {}
    for layer, settings in (config.get("per_layer_config") or {}).items():
        other = sorted(set(settings) - {"head_dim"})
        if other:
            raise ValueError(f"config.json's per_layer_config sets {other} for layer {layer}: no cache layout for it")
        dims[int(layer)] = int(settings["head_dim"])
    return dims


def past_names(layout: KVLayout) -> list[str]:
    return [past_name(i, kind) for i in range(layout.layers) for kind in layout.layer_tensors(i)]


def present_names(layout: KVLayout) -> list[str]:
    return [present_of(name) for name in past_names(layout)]


def layer_windows(model: HuggingFaceModel) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers' own config class reads config.json
    (Qwen2's `use_sliding_window`/`max_window_layers` and Gemma's alternation become its `layer_types`)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model.directory))
    layers = kv_layout(model.config).layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:  # a stateful layer's states are fixed in size: static already (its window: None)
        # DeepSeek-V3.2's indexed attention attends over every token its indexer may choose: no window
        known = {"full_attention", "sliding_attention", "indexed_attention", *STATE_LAYER_KINDS.values()}
        unknown = sorted({kind for kind in types if kind not in known})
        if unknown:
            raise ValueError(f"config.json's layer_types has {unknown}: no static cache for these layers")
        return [window if kind == "sliding_attention" else None for kind in types]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * layers
    return [window] * layers


def static_cache_io(io: GraphIO) -> GraphIO:
    """The static-cache graph's inputs and outputs (passes/static_cache.py) from the dynamic one's: the mask
    over the cache's slots, the caches `cache` long, write_indices [batch] after the other inputs, and logits
    of the last position."""

    def cached(record: TensorRecord) -> TensorRecord:
        if record.name == "attention_mask":
            return record.model_copy(update={"shape": ["batch", CACHE_DIM]})
        if record.name.startswith(("past_key_values.", "present.")) and record.name.endswith((".key", ".value")):
            batch, heads, _, head_dim = record.shape
            return record.model_copy(update={"shape": [batch, heads, CACHE_DIM, head_dim]})
        if record.name == "logits":
            return record.model_copy(update={"shape": [record.shape[0], 1, record.shape[2]]})
        return record

    written = TensorRecord(name=WRITE_INDICES, dtype="int64", shape=["batch"])
    return GraphIO([*map(cached, io.inputs), written], [*map(cached, io.outputs)])


def declare_decoder(config: CompileConfig, model: HuggingFaceModel) -> CompileConfig:
    layout = kv_layout(model.config, config.mla_cache)
    layers = layout.layers
    vocabulary = int(model.config.get("vocab_size") or 2)
    tokens = ["batch", "sequence"]
    inputs = [
        InputDecl(name="input_ids", dtype="int64", dims=tokens, value_range=(0, vocabulary)),
        InputDecl(name="attention_mask", dtype="int64", dims=["batch", "total"]),
        InputDecl(name="position_ids", dtype="int64", dims=tokens, value_range=(0, 1)),  # fed as the positions
        *(
            InputDecl(name=past_name(layer, kind), dtype="float32", dims=layout.dims(kind, layer))
            for layer in range(layers)
            for kind in layout.layer_tensors(layer)
        ),
    ]
    # [generation] max_sequence_length, else [dims.total] max (prompt and new tokens), bounds the other dims; by
    # default the config's positions, capped
    declared_total = config.dims.get("total")
    longest = config.generation.max_sequence_length or (
        declared_total.max if declared_total and declared_total.max else model.max_sequence
    )
    batch = config.generation.max_batch or (config.dims["batch"].max if "batch" in config.dims else None)
    dims = {
        **config.dims,
        "batch": DimRange(max=batch or MAX_BATCH),
        "sequence": DimRange(max=longest),
        "past": DimRange(min=0, max=longest - 1),
        "total": DimRange(max=longest),
    }
    update: dict[str, object] = {
        "inputs": config.inputs or inputs,
        "dims": dims,
        "outputs": config.outputs or ["logits", *present_names(layout)],
    }
    if "opset" not in config.model_fields_set:
        update["opset"] = DECODER_OPSET  # RMSNormalization: ONNX Runtime and TensorRT for RTX take it (measured)
    half = float_regions(on_gpu=True)
    if "precision" not in config.model_fields_set and any(get_target(t).runs(half.name) for t in config.targets):
        update["precision"] = half.name  # a decoder's GPU targets default to fp16 (the cpu target keeps fp32), bf16
        # for a bf16 checkpoint (set before this: quantized_checkpoint.checkpoint_float_precision)
    return config.model_copy(update=update)


def generation_record(
    model: HuggingFaceModel, config: CompileConfig, kv_cache: str = "dynamic", reason: str = "", positions: bool = True
) -> GenerationRecord:
    layout = kv_layout(model.config, config.mla_cache)
    eos = model.generation_config().get("eos_token_id", model.config.get("eos_token_id"))
    return GenerationRecord(
        layers=layout.layers,
        kv_heads=layout.kv_heads,
        head_dim=layout.key_dim,
        value_head_dim=layout.value_dim if layout.value_dim != layout.key_dim else None,
        cache_form=layout.form,
        max_sequence_length=config.dims["total"].max or model.max_sequence,
        eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
        pad_token_id=model.config.get("pad_token_id"),
        kv_cache=kv_cache,
        kv_cache_reason=reason,
        position_ids=positions,
        layer_head_dims=dict(layout.layer_head_dims),
        state_layers=list(layout.states.layers) if layout.states else [],
        state_shapes={kind: list(shape) for kind, shape in layout.states.shapes.items()} if layout.states else {},
    )


def kv_cache_module(loaded: PreTrainedModel, mla_cache: str = "latent") -> torch.nn.Module:
    """`loaded` (a transformers causal LM) as forward(input_ids, attention_mask, position_ids, *past) →
    (logits, *presents), the past tensors of as many layers as it is given (the export may trace fewer): keys
    and values, or a stateful layer's states (config.json's layer_types says which layers: layer_states.py); its
    latent attention, if any, in the `mla_cache` form."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    rewrite_latent_attention(loaded, mla_cache)
    rewrite_linear_attention(loaded)
    rewrite_short_convolution(loaded)
    rewrite_complex_rotary(loaded)  # Llama 4's (DeepSeek-V2's: with its latent attention)
    # the config class's fields: config.json's, with the class's defaults where the file has none
    states = layer_states(cast("ConfigJson", loaded.config.to_dict()))

    def cache_layers(past: tuple[torch.Tensor, ...]) -> list[DynamicLayer | StateLayer]:
        """The past tensors as transformers' cache layers: keys and values, or a stateful layer's states."""
        layers: list[DynamicLayer | StateLayer] = []
        while past:
            index = len(layers)
            if states is not None and index in states.layers:
                layers.append(StateLayer(dict(zip(states.shapes, past, strict=False))))
                past = past[len(states.shapes) :]
                continue
            layer = DynamicLayer()
            # the tensors as they are: DynamicLayer.update would concatenate onto an empty 1-D tensor
            layer.keys, layer.values = past[0], past[1]
            layer.device, layer.is_initialized = past[0].device, True
            layer.dtype = past[0].dtype  # type: ignore[attr-defined]  # read by transformers' layers
            layers.append(layer)
            past = past[2:]
        return layers

    def layer_outputs(layer: CachedKeysValues | StateLayer) -> list[torch.Tensor]:
        return list(layer.states.values()) if isinstance(layer, StateLayer) else [layer.keys, layer.values]

    class FlatKVCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = loaded

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            cache = DynamicCache()
            cache.layers.extend(cache_layers(past))
            with token_masks_while_tracing(self.model), real_rotation_while_tracing(self.model):
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=True,
                    return_dict=True,
                )
            presents: list[torch.Tensor] = []
            for layer in out.cache.layers:
                presents += layer_outputs(layer)
            return (out.logits, *presents)

    return FlatKVCache().eval()
