"""What config.json rules out before any work: models whose layers keep a state that is not attention's KV cache
(state-space, recurrent and linear-attention layers, alone or mixed with attention), and encoder-decoders."""

from __future__ import annotations

from pathlib import Path

from tensorsmith.compiler.frontend.config_json import ConfigJson
from tensorsmith.core.errors import ConfigError

SUPPORTED = (
    "tensorsmith compiles transformer families' decoders (*ForCausalLM, *LMHeadModel), encoders (*Model) "
    "and heads (*For…)"
)
# model types whose layers keep a state that is no attention's KV cache (state-space, recurrent, hybrids of them)
RECURRENT_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "rwkv",
        "xlstm",
        "recurrent_gemma",
        "jamba",
        "zamba",
        "zamba2",
        "bamba",
        "falcon_h1",
        "granitemoehybrid",
        "nemotron_h",
    }
)
# families whose stateful layers the export writes, by the kind config.json's layer_types gives them: Gated DeltaNet
# as Qwen writes it (compiler/frontend/linear_attention.py), LFM2's short convolutions (short_convolution.py)
STATE_LAYER_KINDS = {
    "qwen3_5_text": "linear_attention",
    "qwen3_5_moe_text": "linear_attention",
    "qwen3_next": "linear_attention",
    "lfm2": "conv",
    "lfm2_moe": "conv",
}


# layer kinds whose only state is a KV cache (or none): an MoE or MLP block, attention in full, a window or chunks,
# DeepSeek-V3.2's indexed attention (its indexer's keys cached beside the latent: indexed_attention.py)
KV_CACHE_LAYER_KINDS = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe", "indexed_attention"}
)


def check_architecture(directory: Path, architecture: str, config: ConfigJson) -> None:
    """A model transformers builds but the export cannot take, said from config.json before any work (else the
    export fails after seconds, in the exporter's words)."""
    model_type = config.get("model_type")
    if config.get("is_encoder_decoder"):
        kind = "an encoder-decoder model"
        hint = "compile a factory that returns the half to run, e.g. model.get_encoder()"
    elif model_type in RECURRENT_TYPES or _stateful_layer_kinds(config):
        kinds = ", ".join(_stateful_layer_kinds(config)) or "state-space or recurrent"
        kind = f"a model with {kinds} layers (model_type {model_type!r})"
        hint = (
            "their state is not a KV cache: tensorsmith's decoders cache attention layers' keys and values; "
            "compile an ONNX export of the model"
        )
    elif config.get("num_kv_shared_layers"):  # Gemma 3n's and 4's small models: later layers read earlier caches
        kind = f"a model whose last {config['num_kv_shared_layers']} layers share earlier layers' keys and values"
        hint = "caches shared between layers are not supported yet; compile an ONNX export of the model"
    else:
        return
    raise ConfigError(f"{directory} holds a {architecture}, {kind}; {SUPPORTED}", hint=hint)


def _stateful_layer_kinds(config: ConfigJson) -> list[str]:
    """The kinds of layers config.json lists (`layer_types`, Granite 4's `layers_block_type`) that keep a state
    other than attention's keys and values and not among STATE_LAYER_KINDS: Mamba's `linear_attention`, Falcon-H1's
    `hybrid`."""
    kinds = config.get("layer_types") or config.get("layers_block_type") or []
    own = STATE_LAYER_KINDS.get(str(config.get("model_type")))
    cached = KV_CACHE_LAYER_KINDS | ({own} if own else set())
    return sorted({kind for kind in kinds if isinstance(kind, str)} - cached)
