"""bench/shapes.py writes, tensor by tensor, what `save_pretrained` would write for the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from bench.shapes import SHAPES, meta_model, saved_state_dict, shape_config, write_checkpoint  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128}  # fmt: skip
# Tied Llama (lm_head not saved) and untied Qwen2 (q/k/v biases), sharded small to exercise the index.
CASES = {
    "llama-tied": {**SHAPES["smollm-135m"], **TINY},
    "qwen2-untied": {**SHAPES["qwen2.5-14b"], **TINY},
    # Gated DeltaNet beside full attention: A_log, dt_bias and the depthwise convolution have their own initialisers
    "qwen3.5-hybrid": {**SHAPES["qwen3.5-0.8b"], **TINY, "head_dim": 16, "linear_num_key_heads": 2,
                       "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                       "full_attention_interval": 2},
}  # fmt: skip


def _config(values: dict) -> transformers.PretrainedConfig:
    values = dict(values)
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


def _files(directory: Path) -> dict[str, dict[str, tuple]]:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            slices = {key: handle.get_slice(key) for key in sorted(handle.keys())}
            found[path.name] = {key: (part.get_shape(), part.get_dtype()) for key, part in slices.items()}
            found[path.name]["__metadata__"] = handle.metadata()
    return found


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in sorted(handle.keys())})
    return tensors


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("max_shard_size", [100_000, "2GB"])
def test_layout_matches_save_pretrained(case: str, max_shard_size: int | str, tmp_path: Path) -> None:
    written, reference = tmp_path / "written", tmp_path / "reference"
    write_checkpoint(_config(CASES[case]), written, seed=0, max_shard_size=max_shard_size)
    model = transformers.AutoModelForCausalLM.from_config(_config(CASES[case]), dtype=torch.bfloat16)
    model.save_pretrained(reference, max_shard_size=max_shard_size)

    assert sorted(p.name for p in written.iterdir()) == sorted(p.name for p in reference.iterdir())
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        if (reference / name).exists():
            assert json.loads((written / name).read_text()) == json.loads((reference / name).read_text()), name
    assert json.loads((written / "config.json").read_text())["dtype"] == "bfloat16"
    assert _files(written) == _files(reference)
    assert (len(_files(written)) > 1) == (max_shard_size != "2GB")


@pytest.mark.parametrize("case", CASES)
def test_loads_and_runs(case: str, tmp_path: Path) -> None:
    write_checkpoint(_config(CASES[case]), tmp_path, seed=0, max_shard_size=100_000)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 42]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()


def test_weights_are_seeded_and_independent_of_the_shard_plan(tmp_path: Path) -> None:
    config = CASES["qwen2-untied"]
    write_checkpoint(_config(config), tmp_path / "a", seed=3, max_shard_size=100_000)
    write_checkpoint(_config(config), tmp_path / "b", seed=3)
    write_checkpoint(_config(config), tmp_path / "c", seed=4)
    a, b, c = (_tensors(tmp_path / name) for name in "abc")
    assert a.keys() == b.keys() == c.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[weight], c[weight])
    assert not torch.equal(a[weight], a["model.layers.1.self_attn.q_proj.weight"])
    assert abs(a[weight].float().std().item() - 0.02) < 0.002
    assert torch.equal(a["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert not a["model.layers.0.self_attn.q_proj.bias"].any()


@pytest.mark.parametrize(
    ("shape", "parameters"),
    [("llama-3.1-8b", 8_030_261_248), ("qwen2.5-7b", 7_615_616_512), ("qwen2.5-14b", 14_770_033_664)],
)
def test_large_shapes_match_the_released_parameter_counts(shape: str, parameters: int) -> None:
    model = meta_model(shape_config(shape))
    assert model.num_parameters() == parameters
    assert "lm_head.weight" in saved_state_dict(model)
