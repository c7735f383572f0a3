"""A Hugging Face model directory as read from its config.json (compiler/frontend/huggingface.py reads it): its
architecture, config and files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.compiler.frontend.config_json import ConfigJson, GenerationConfigJson
from tensorsmith.compiler.frontend.quantized_checkpoint import QuantizedCheckpoint, weights_reader
from tensorsmith.core.quantization_declared import declared_method

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")  # fmt: skip

MAX_SEQUENCE = 2048  # the default max of the sequence dim: the config's positions, capped here


def is_decoder(architecture: str) -> bool:
    return architecture.endswith(("ForCausalLM", "LMHeadModel"))


@dataclass(frozen=True)
class HuggingFaceModel:
    directory: Path
    architecture: str  # e.g. "BertModel", from config.json's `architectures`
    config: ConfigJson
    quantized: QuantizedCheckpoint | None = None  # a pre-quantized checkpoint's quantized Linears

    @property
    def output(self) -> str:
        return "last_hidden_state" if self.architecture.endswith("Model") else "logits"

    @property
    def max_sequence(self) -> int:
        given = (self.config.get("max_position_embeddings"), self.config.get("n_positions"), self.config.get("n_ctx"))
        positions = next((value for value in given if value), MAX_SEQUENCE)
        return min(int(positions), MAX_SEQUENCE)

    @property
    def is_decoder(self) -> bool:
        return is_decoder(self.architecture)

    @property
    def declared_method(self) -> str | None:
        """The `quant_method` its config.json (or Model Optimizer's file) declares: its weights are then read
        dequantized, never by transformers' quantizers."""
        return declared_method(self.directory, self.config)

    def checkpoint_weights(self) -> CheckpointWeights:
        """Its tensors by name, quantized weights as the float weights their format dequantizes to (its
        quantization read once, when the directory was)."""
        return weights_reader(self.directory, self.declared_method, self.quantized)

    def generation_config(self) -> GenerationConfigJson:
        path = self.directory / "generation_config.json"
        read: GenerationConfigJson = json.loads(path.read_text()) if path.is_file() else {}
        return read

    def weights(self) -> list[Path]:
        return sorted(self.directory.glob("*.safetensors"))

    def tokenizer_files(self) -> list[Path]:
        return [self.directory / name for name in TOKENIZER_FILES if (self.directory / name).is_file()]
