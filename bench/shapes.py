"""Decoders of public models' shapes, for the benchmarks at real scale: config.json values of the released
models, seeded random weights in bf16 laid out as `save_pretrained` lays them out (safetensors shards of 2 GB
and their index), with the tinylm sample's tokenizer (a vocabulary of 2,048 inside theirs; the benchmarks
measure shapes, not text).

The weights are drawn and written tensor by tensor, one shard in memory at a time, so that an 8B checkpoint
is written on a machine with less memory than the model: the model itself is only built on the meta device,
to learn the keys, shapes and ties that `save_pretrained` would write.

    python -m bench.shapes smollm-135m /tmp/shapes/smollm-135m
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import transformers

SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "tinylm" / "checkpoint"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_SHARD_SIZE = "2GB"
# float32 values drawn per step (128 MB), then rounded into the bf16 tensor: a proper normal's tails without a
# float32 copy of the largest tensor. Part of the format: changing it changes the weights a seed gives.
_CHUNK = 1 << 25

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
# Qwen2.5's sizes share these (positions, norm epsilon, rope base)
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "bos_token_id": 1, "eos_token_id": 2, "use_sliding_window": False, "max_position_embeddings": 32768,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}  # fmt: skip

# The released config.json values that fix the shapes (HuggingFaceTB/SmolLM-135M, Qwen/Qwen2.5-0.5B,
# meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-3B, Qwen/Qwen2.5-7B, meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-14B);
# token ids moved to the sample tokenizer's.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm-135m": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                    "tie_word_embeddings": True},
    "qwen2.5-0.5b": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "llama-3.2-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "tie_word_embeddings": True},
    "qwen2.5-3b": {**_QWEN2, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
                   "tie_word_embeddings": True},
    "qwen2.5-7b": {**_QWEN2, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "llama-3.1-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "tie_word_embeddings": False},
    "qwen2.5-14b": {**_QWEN2, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
                    "tie_word_embeddings": False},
    # deepseek-ai/DeepSeek-V2-Lite: latent attention (kv_lora_rank 512, no query LoRA), a dense first layer, then
    # 64 routed experts (6 active) and 2 shared; 15.7B parameters, 2.4B active
    "deepseek-v2-lite": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_act": "silu",
                         "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                         "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                         "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
                         "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
                         "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy",
                         "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
                         "vocab_size": 102400, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
                         "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 40,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707}, "tie_word_embeddings": False, "bos_token_id": 1,
                         "eos_token_id": 2},
    # Qwen/Qwen3.5-0.8B's text decoder: 24 layers, three Gated DeltaNet layers (16 heads of 128 for keys and
    # values, a convolution of 4) to each gated full-attention layer (8 heads of 256, 2 for keys and values)
    "qwen3.5-0.8b": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_act": "silu",
                     "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
                     "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                     "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "vocab_size": 248320,
                     "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                         "partial_rotary_factor": 0.25}, "bos_token_id": 1, "eos_token_id": 2},
}  # fmt: skip


# gpt-oss-20b's width (32 experts of 2880 x 5760 and 2880 x 2880, 4 routed) at 2 of its 24 layers: its experts
# in MXFP4 as published are bench/mxfp4.py's; the other layers add only depth
SHAPES["gpt-oss-20b-2-layers"] = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                                  "num_local_experts": 32, "num_experts_per_tok": 4, "num_hidden_layers": 2,
                                  "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
SHAPES["gpt-oss-20b-1-layer"] = {**SHAPES["gpt-oss-20b-2-layers"], "num_hidden_layers": 1,
                                 "layer_types": ["full_attention"]}  # fmt: skip


def shape_config(shape: str) -> transformers.PretrainedConfig:
    import transformers

    values = dict(SHAPES[shape])
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


def make_checkpoint(shape: str, directory: Path, seed: int = 0) -> Path:
    """Write the checkpoint (bf16 safetensors, sharded as save_pretrained shards) unless it is there already."""
    if (directory / "config.json").is_file():
        return directory
    scratch = directory.with_name(directory.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    write_checkpoint(shape_config(shape), scratch, seed)
    for name in TOKENIZER_FILES:
        shutil.copy(SAMPLE / name, scratch / name)
    scratch.rename(directory)
    return directory


def meta_model(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    """The model's structure without its memory: what its state_dict holds, and which of it is tied."""
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def saved_state_dict(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """The (meta) tensors `save_pretrained` writes, in its order: the state_dict less the ignored and tied keys."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state_dict = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state_dict.pop(key, None)
    return remove_tied_weights_from_state_dict(state_dict, model)


def write_checkpoint(
    config: transformers.PretrainedConfig, directory: Path, seed: int = 0, max_shard_size: int | str = MAX_SHARD_SIZE
) -> None:
    """Write config, generation config and seeded weights as `save_pretrained(directory, max_shard_size=...)`
    would write the model, one shard in memory at a time."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    model = meta_model(config)
    state_dict = saved_state_dict(model)
    split = split_torch_state_dict_into_shards(
        state_dict, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    directory.mkdir(parents=True, exist_ok=True)
    model.config.dtype = "bfloat16"  # as save_pretrained records the dtype it saved
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
    shards = split.filename_to_tensors
    for number, (filename, names) in enumerate(shards.items(), 1):
        start = time.perf_counter()
        tensors = {name: initial_tensor(model, name, state_dict[name], seed) for name in names}
        save_file(tensors, directory / filename, metadata={"format": "pt"})
        size = sum(tensor.nbytes for tensor in tensors.values())
        del tensors
        print(
            f"{directory.name}: {filename} ({number}/{len(shards)}, {size / 1e9:.2f} GB) "
            f"in {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def initial_tensor(model: transformers.PreTrainedModel, name: str, meta: torch.Tensor, seed: int) -> torch.Tensor:
    """The tensor `name` as transformers' `_init_weights` would set it (normal(0, initializer_range) for Linear and
    Embedding weights, ones for norm weights, zeros for biases), drawn from a generator seeded by seed and name
    alone, so that the bytes do not depend on the order or the shard plan."""
    import torch
    from torch import nn

    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    kind = type(module).__name__
    tensor = torch.empty(meta.shape, dtype=meta.dtype)
    if attribute == "bias" or attribute.endswith("_bias") or attribute == "sinks":  # gpt-oss: experts' biases, sinks
        return tensor.zero_()
    if attribute == "weight" and ("RMSNorm" in kind or "LayerNorm" in kind):
        return tensor.fill_(1.0)
    stacked = meta.dim() == 3 and attribute.endswith("_proj")  # a mixture's experts, [experts, out, in]
    router = attribute == "weight" and "Router" in kind  # a gate's [experts, hidden], nn.Linear's layout
    if attribute == "e_score_correction_bias":
        return tensor.zero_()
    if attribute == "dt_bias":  # Gated DeltaNet's decay: its own initialisation (ones; A from 1 to 16, as log)
        return tensor.fill_(1.0)
    if attribute == "A_log":
        return torch.linspace(1.0, 16.0, tensor.numel()).log().to(tensor.dtype).view(tensor.shape)
    layers = (nn.Linear, nn.Embedding, nn.Conv1d)  # Conv1d: Gated DeltaNet's depthwise convolution
    if not (stacked or router) and (attribute != "weight" or not isinstance(module, layers)):
        raise ValueError(f"no initialisation known for {name} ({kind})")
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    std = getattr(model.config, "initializer_range", None) or 0.02
    flat = tensor.view(-1)
    for begin in range(0, flat.numel(), _CHUNK):
        chunk = flat[begin : begin + _CHUNK]
        chunk.copy_(torch.empty(chunk.numel(), dtype=torch.float32).normal_(0.0, std, generator=generator))
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        tensor[module.padding_idx].zero_()
    return tensor


if __name__ == "__main__":
    print(make_checkpoint(sys.argv[1], Path(sys.argv[2])))
