"""The export cache (compiler/frontend/export_cache.py): a second compile of the same checkpoint, wherever it lies,
with other precisions or targets, gets the fused graph without exporting; other bytes, other export settings or a
damaged entry export again; a factory is keyed by its module's weights and source files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tensorsmith.compiler.frontend.export_cache import ENTRY_INFO, FROM_EXPORT_CACHE
from tensorsmith.runtime.manifest import sha256_of
from tests.compiler.test_checkpoint_dtypes import save_in
from tests.conftest import run_cli, run_cli_json


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertConfig

    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)  # fmt: skip
    directory = tmp_path_factory.mktemp("cached") / "bert"
    save_in(torch.bfloat16, "BertModel", config, directory, scale=0.02)
    return directory


@pytest.fixture(scope="module")
def first(bert: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The cache after one fp32 cpu compile of `bert`, and that compile's manifest."""
    directory = tmp_path_factory.mktemp("first")
    _, manifest = _compile(bert, directory / "out", directory / "cache", "--target", "cpu")
    return directory / "cache", manifest


def _compile(source: Path | str, out: Path, cache: Path, *flags: str) -> tuple[dict, dict]:
    compiled = run_cli_json("compile", source, "-o", out, "--export-cache", cache, *flags)
    return compiled, json.loads((out / "manifest.json").read_text())


def _exported(manifest: dict) -> bool:
    (step,) = [step["name"] for step in manifest["steps"] if step["name"].startswith("exporting")]
    return FROM_EXPORT_CACHE not in step


@pytest.mark.slow
def test_a_second_compile_of_the_same_bytes_skips_the_export(
    bert: Path, first: tuple[Path, dict], tmp_path: Path
) -> None:
    cache, manifest = first
    moved = shutil.copytree(bert, tmp_path / "elsewhere")  # the key is the bytes, not the path
    compiled, second = _compile(moved, tmp_path / "second", cache, "--target", "cpu", "--target", "sm_86",
                                "--precision", "fp16")  # fmt: skip
    first = manifest
    assert _exported(first) and not _exported(second)
    assert second["model"] == first["model"]  # the same fused graph, its sha256 checked when it was copied
    assert second["source"]["path"] == str(moved) and second["source"]["sha256"] == first["source"]["sha256"]
    assert [p["name"] for p in second["passes"] if not p["variant"]] == [p["name"] for p in first["passes"]]
    assert second["variants"][0]["accuracy"] == first["variants"][0]["accuracy"]  # verification's figures
    assert {target["name"]: target["status"] for target in compiled["targets"]} == {"cpu": "not-needed",
                                                                                    "sm_86": "built"}  # fmt: skip


def _program(path: Path, seed: int) -> Path:
    """A small ExportedProgram saved as .pt2 (its export to ONNX is quick: no capture), weights from `seed`."""
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.GELU()).eval()
    batch = torch.export.Dim("batch")
    torch.export.save(torch.export.export(module, (torch.randn(4, 6),), dynamic_shapes=({0: batch},)), str(path))
    return path


@pytest.mark.slow
def test_other_bytes_or_export_settings_export_again(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    program = _program(tmp_path / "model.pt2", seed=0)
    flags = ("--input", "x:float32:batch,6", "--target", "cpu")
    _, first = _compile(program, tmp_path / "first", cache, *flags)
    _, again = _compile(program, tmp_path / "again", cache, *flags, "--budget", "cosine>=0.9")  # a back-end field
    _, opset = _compile(program, tmp_path / "opset", cache, *flags, "--opset", "21")
    _, other = _compile(_program(tmp_path / "other.pt2", seed=1), tmp_path / "other", cache, *flags)
    assert [_exported(m) for m in (first, again, opset, other)] == [True, False, True, True]
    assert len(list(cache.glob("*/*/" + ENTRY_INFO))) == 3


def test_a_damaged_entry_exports_again(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    program = _program(tmp_path / "model.pt2", seed=0)
    _compile(program, tmp_path / "first", cache, "--input", "x:float32:batch,6")
    (stored,) = cache.glob("*/*/model.onnx")
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF
    stored.write_bytes(bytes(data))
    result = run_cli("-v", "compile", program, "--input", "x:float32:batch,6", "-o", tmp_path / "again",
                     "--export-cache", cache)  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "is damaged: exporting again" in result.stderr
    assert _exported(json.loads((tmp_path / "again" / "manifest.json").read_text()))
    assert sha256_of(stored) == json.loads((stored.parent / ENTRY_INFO).read_text())["sha256"]  # stored anew


@pytest.mark.slow
def test_a_factory_is_keyed_by_its_module_code_and_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same module again hits; other weights, or another content of the file that defines the factory and its
    class, miss."""
    from tensorsmith.compiler.frontend import export_cache

    cache = tmp_path / "cache"
    flags = ("--input", "x:float32:batch,6", "--target", "cpu")
    factory = "tests.compiler.test_export_cache:small_factory"
    _, first = _compile(factory, tmp_path / "first", cache, *flags)
    _, same = _compile(factory, tmp_path / "same", cache, *flags)
    monkeypatch.setenv("SMALL_FACTORY_SEED", "1")
    _, weights = _compile(factory, tmp_path / "weights", cache, *flags)
    monkeypatch.delenv("SMALL_FACTORY_SEED")
    original = export_cache.sha256_of  # another file content for the class's source file: a miss
    monkeypatch.setattr(export_cache, "sha256_of",
                        lambda path: "edited" if path.name == "test_export_cache.py" else original(path))  # fmt: skip
    _, edited = _compile(factory, tmp_path / "edited", cache, *flags)
    assert [_exported(m) for m in (first, same, weights, edited)] == [True, False, True, True]
    assert same["source"] == first["source"] and same["source"]["path"] == factory  # as this compile names it


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x))


def small_factory() -> torch.nn.Module:
    import os

    torch.manual_seed(int(os.environ.get("SMALL_FACTORY_SEED", "0")))
    return _Small().eval()
