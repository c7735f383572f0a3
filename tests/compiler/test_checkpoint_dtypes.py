"""Hugging Face checkpoints saved in bfloat16 and float16 (`model.to(dtype).save_pretrained(dir)`) compile as
float32 ones do: the reference and the fp32 graph are what transformers computes in float32 from those weights
(`from_pretrained(dir, dtype=torch.float32)`), the GPU variants stay fp16, with the layers whose weights or
activations leave fp16's range kept in fp32 and named. A dtype the compile cannot take is one line naming it and
the file, before the export."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.runtime import load
from tests.cli.test_bad_inputs import FACTORY, MLP_INPUT, mlp_factory
from tests.compiler.test_decoders import COMMON, DECODER, _families, assert_greedy_tokens_match
from tests.conftest import max_relative_error, run_cli, run_cli_json

NEW_TOKENS = 8
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def families() -> dict[str, tuple[str, Callable[[], Any]]]:
    """test_decoders' families, with Qwen2 and Phi3."""
    import transformers as t

    return {
        **_families(),
        "qwen2": ("Qwen2ForCausalLM", lambda: t.Qwen2Config(**DECODER, **COMMON)),
        "phi3": ("Phi3ForCausalLM", lambda: t.Phi3Config(**DECODER, **COMMON)),
    }


def save_in(dtype: torch.dtype, architecture: str, config: Any, directory: Path, scale: float = 0.15) -> Any:
    """A seeded random checkpoint saved in `dtype` (weights scaled up so that greedy choices are not near-ties;
    biases and norms moved off their zeros and ones, as trained ones are), and transformers' own model of it loaded
    in float32."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, scale)
            else:
                parameter.add_(torch.randn_like(parameter), alpha=0.02)
    model.to(dtype).save_pretrained(str(directory))
    saved = json.loads((directory / "config.json").read_text())
    assert (saved.get("dtype") or saved.get("torch_dtype")) == str(dtype).removeprefix("torch.")
    return getattr(transformers, architecture).from_pretrained(str(directory), dtype=torch.float32).eval()


def save_decoder(family: str, dtype: torch.dtype, directory: Path) -> Any:
    architecture, make_config = families()[family]
    return save_in(dtype, architecture, make_config(), directory)


# bfloat16 for all five families, float16 for two: each compile takes 15-25 s here
HALF_CHECKPOINTS = [*((family, "bfloat16") for family in ("llama", "qwen2", "mistral", "gpt2", "phi3")),
                    *((family, "float16") for family in ("llama", "gpt2"))]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("family", "dtype"), HALF_CHECKPOINTS)
def test_a_half_checkpoint_generates_transformers_float32_tokens(family: str, dtype: str, tmp_path: Path) -> None:
    reference = save_decoder(family, DTYPES[dtype], tmp_path / "checkpoint")
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu"]})
    manifest = compile(config, tmp_path / "out").manifest
    assert manifest.source.exporter == "dynamo" and manifest.targets[0].variant == "fp32"
    assert_greedy_tokens_match(reference, tmp_path / "out", NEW_TOKENS)


def test_a_bfloat16_encoder_matches_transformers_in_float32(tmp_path: Path) -> None:
    from transformers import BertConfig

    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)  # fmt: skip
    reference = save_in(torch.bfloat16, "BertModel", config, tmp_path / "bert", scale=0.02)
    run_cli_json("compile", tmp_path / "bert", "-o", tmp_path / "out", "--target", "cpu")
    ids = np.random.default_rng(0).integers(0, 100, (2, 16)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    with torch.inference_mode():
        expected = reference(**{name: torch.from_numpy(a) for name, a in feeds.items()}).last_hidden_state.numpy()
    with load(tmp_path / "out") as model:
        actual = model.run(feeds)["last_hidden_state"]
    cosine = float(np.dot(expected.ravel(), actual.ravel()) / (np.linalg.norm(expected) * np.linalg.norm(actual)))
    assert cosine > 0.9999 and max_relative_error(expected, actual) <= 1e-4


@pytest.mark.slow
def test_a_bfloat16_decoder_builds_bf16_engines_and_fp16_for_turing(tmp_path: Path) -> None:
    """The checkpoint's own type by default where the GPU runs it; `--precision fp16` still asks for fp16."""
    save_decoder("llama", torch.bfloat16, tmp_path / "checkpoint")
    compiled = run_cli_json("compile", tmp_path / "checkpoint", "-o", tmp_path / "out",
                            "--target", "sm_75", "--target", "sm_86", "--target", "sm_120")  # fmt: skip
    targets = {target["name"]: target for target in compiled["targets"]}
    assert {name: target["variant"] for name, target in targets.items()} == {"sm_75": "fp16", "sm_86": "bf16",
                                                                               "sm_120": "bf16"}  # fmt: skip
    assert "no bf16 kernels" in targets["sm_75"]["reason"]
    (fp16,) = [record for record in compiled["passes"] if record["name"] == "convert_to_fp16"]
    assert fp16["variant"] == "fp16" and fp16["counts"]["kept_fp32_for_range"] == 0  # nothing beyond fp16 here
    assert all(target["status"] == "built" for target in targets.values()), targets
    asked = run_cli_json("compile", tmp_path / "checkpoint", "-o", tmp_path / "asked", "--target", "sm_86",
                         "--precision", "fp16")  # fmt: skip
    assert [target["variant"] for target in asked["targets"]] == ["fp16"]


def _small_bert(directory: Path) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    BertModel(config).to(torch.bfloat16).save_pretrained(str(directory))
    return directory


def _weight_as(dtype: torch.dtype) -> Callable[[Path], tuple[list[str], str]]:
    def damage(tmp: Path) -> tuple[list[str], str]:
        directory = _small_bert(tmp / "bert")
        state = load_file(str(directory / "model.safetensors"))
        name = next(key for key in sorted(state) if key.endswith("query.weight"))
        state[name] = state[name].float().clamp(-1, 1).to(dtype)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return [str(directory)], f"{directory / 'model.safetensors'} holds {str(dtype).removeprefix('torch.')} "

    return damage


def _config_with(**fields: Any) -> Callable[[Path], tuple[list[str], str]]:
    def damage(tmp: Path) -> tuple[list[str], str]:
        directory = _small_bert(tmp / "bert")
        config = json.loads((directory / "config.json").read_text())
        config.pop("dtype", None)  # as transformers before 4.56 saved it: torch_dtype only
        (directory / "config.json").write_text(json.dumps({**config, **fields}))
        return [str(directory)], str(directory / "config.json")

    return damage


def _factory_checkpoint_int8(tmp: Path) -> tuple[list[str], str]:
    state = {name: tensor.to(torch.int8) if name == "0.weight" else tensor
             for name, tensor in mlp_factory().state_dict().items()}  # fmt: skip
    save_file(state, str(tmp / "w.safetensors"))
    return [FACTORY, "--checkpoint", str(tmp / "w.safetensors"), *MLP_INPUT], f"{tmp / 'w.safetensors'} holds"


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (_weight_as(torch.int8), "int8"),  # dtypes, not precisions
        (_weight_as(torch.float8_e4m3fn), "float8_e4m3fn"),
        (_config_with(dtype="float8"), "dtype 'float8'"),
        (_config_with(torch_dtype="int4"), "torch_dtype 'int4'"),  # dtypes, not precisions
        (_config_with(quantization_config={"quant_method": "bitsandbytes"}), "quant_method is 'bitsandbytes'"),
        (_factory_checkpoint_int8, "0.weight as int8"),  # dtypes, not precisions
    ],
    ids=["int8 weight", "float8 weight", "config dtype", "config torch_dtype", "quantization_config", "factory"],
)
def test_a_dtype_it_cannot_take_is_one_line_before_the_export(
    damage: Callable[[Path], tuple[list[str], str]], named: str, tmp_path: Path
) -> None:
    arguments, file = damage(tmp_path)
    result = run_cli("compile", *arguments, "-o", tmp_path / "out", "--target", "cpu")
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and named in lines[0] and file in lines[0] and "(hint: " in lines[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    if arguments[0] != FACTORY:  # a directory's dtypes are read with its config; a factory's once it is built
        assert "exporting" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def _bert_beyond_fp16(directory: Path) -> Path:
    """A bf16 BERT whose attention output projection holds a weight of 9e4 (bf16 holds it, fp16 does not) and whose
    MLP's up projection reaches ~1e5 (its weights, of std 0.02, scaled by 5e5)."""

    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    model = BertModel(config).eval()
    layer = model.encoder.layer[0]
    with torch.no_grad():
        layer.attention.output.dense.weight[7, 3] = 9e4
        layer.intermediate.dense.weight.mul_(5e5)
    model.to(torch.bfloat16).save_pretrained(str(directory))
    return directory


@pytest.mark.slow
def test_a_bfloat16_checkpoint_beyond_fp16s_range_keeps_those_layers_in_fp32(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import onnx
    from onnx.reference import ReferenceEvaluator

    from tensorsmith.core.sessions import run_onnx
    from tensorsmith.passes.fp16 import ConvertToHalf
    from tests.passes.graphs import apply
    from tests.passes.test_fp16 import UNCHECKED

    source = _bert_beyond_fp16(tmp_path / "bert")
    caplog.set_level(logging.INFO, logger="tensorsmith.compiler.variants.float_builder")
    config = CompileConfig.create({"source": str(source), "targets": ["sm_86"], "precision": "fp16"})
    manifest = compile(config, tmp_path / "out").manifest
    assert manifest.variant("fp16").path == "variants/fp16.onnx"

    (record,) = [record for record in manifest.passes if record.name == "convert_to_fp16"]
    kept = record.details["kept_fp32_for_range"]
    assert record.variant == "fp16" and isinstance(kept, dict) and record.counts["kept_fp32_for_range"] == len(kept)
    reasons = {(why.get("module"), why["op"], why["reason"]) for why in kept.values()}
    assert ("model.encoder.layer.0.attention.output.dense", "MatMul", "weight") in reasons, reasons
    assert ("model.encoder.layer.0.intermediate.dense", "MatMul", "output") in reasons, reasons
    weight = next(why for why in kept.values() if why["reason"] == "weight")
    assert weight["max_abs"] == pytest.approx(9e4, rel=1 / 128)  # in bf16
    (line,) = [r.getMessage() for r in caplog.records if "kept in fp32 for fp16's range" in r.getMessage()]
    assert line.startswith(f"fp16: {len(kept)} nodes kept in fp32") and "model.encoder.layer.0." in line

    # The fp16 file in fp16 arithmetic against the fp32 graph; and fp16 without the range check, which fails
    ids = np.random.default_rng(0).integers(0, 100, (2, 12)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    fp32 = onnx.load(str(tmp_path / "out" / "model.onnx"))
    expected = run_onnx(fp32, feeds)[0]
    (actual, *_) = ReferenceEvaluator(str(tmp_path / "out" / "variants" / "fp16.onnx")).run(None, feeds)
    assert np.isfinite(actual).all() and max_relative_error(expected, actual) < 2e-2
    unchecked, _ = apply(fp32, [ConvertToHalf(half=UNCHECKED)])
    (wrong, *_) = ReferenceEvaluator(unchecked).run(None, feeds)
    assert not np.isfinite(wrong).all() or max_relative_error(expected, wrong) > 0.1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_sharded_bfloat16_checkpoint_loads_as_transformers_loads_it(family: str, tmp_path: Path) -> None:
    """The module is read with safetensors' pread backend (huggingface.build_module), shard by shard as the index
    names them: the same float32 parameters as transformers' own loader, tied weights tied."""
    import transformers

    from tensorsmith.compiler.frontend.huggingface import build_module, read_model_directory

    architecture, make_config = families()[family]
    torch.manual_seed(0)
    getattr(transformers, architecture)(make_config()).to(torch.bfloat16).save_pretrained(
        str(tmp_path), max_shard_size="200KB")  # fmt: skip
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    expected = getattr(transformers, architecture).from_pretrained(str(tmp_path), dtype=torch.float32)
    module = build_module(read_model_directory(tmp_path), ["input_ids"])
    loaded = dict(module.named_parameters(remove_duplicate=False))
    for name, parameter in expected.named_parameters(remove_duplicate=False):
        (ours,) = [value for key, value in loaded.items() if key.endswith(f"model.{name}") or key == name]
        assert ours.dtype == torch.float32 and torch.equal(ours, parameter), name
    embedding, head = module.model.get_input_embeddings(), module.model.get_output_embeddings()
    tied = head.weight.data_ptr() == embedding.weight.data_ptr()
    assert tied == bool(expected.config.tie_word_embeddings)
