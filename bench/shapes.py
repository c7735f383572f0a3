"""Decoders of public models' shapes, for the benchmarks at real scale: config.json values of the released
models, seeded random weights, saved in bf16 with `save_pretrained` (as the models are published), with the
tinylm sample's tokenizer (a vocabulary of 2,048 inside theirs; the benchmarks measure shapes, not text).

    python -m bench.shapes smollm-135m /tmp/shapes/smollm-135m
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "tinylm" / "checkpoint"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "bos_token_id": 1, "eos_token_id": 2, "use_sliding_window": False}  # fmt: skip

# The released config.json values that fix the shapes (HuggingFaceTB/SmolLM-135M, Qwen/Qwen2.5-0.5B,
# meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-3B); token ids moved to the sample tokenizer's.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm-135m": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                    "tie_word_embeddings": True},
    "qwen2.5-0.5b": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                     "tie_word_embeddings": True},
    "llama-3.2-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "tie_word_embeddings": True},
    "qwen2.5-3b": {**_QWEN2, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "tie_word_embeddings": True},
}  # fmt: skip


def make_checkpoint(shape: str, directory: Path, seed: int = 0) -> Path:
    """Write the checkpoint (bf16 safetensors, sharded as save_pretrained shards) unless it is there already."""
    import torch
    import transformers

    if (directory / "config.json").is_file():
        return directory
    values = dict(SHAPES[shape])
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    scratch = directory.with_name(directory.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    model.save_pretrained(scratch)
    for name in TOKENIZER_FILES:
        shutil.copy(SAMPLE / name, scratch / name)
    scratch.rename(directory)
    return directory


if __name__ == "__main__":
    print(make_checkpoint(sys.argv[1], Path(sys.argv[2])))
