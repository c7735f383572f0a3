"""Decoders from Hugging Face directories (small seeded checkpoints saved here with transformers): compile with a
KV cache, then `generate` gives exactly transformers' tokens (greedy with a left-padded batch, and 4 beams), and
the logits match within 1e-4."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.runtime import load
from tests.conftest import max_relative_error

NEW_TOKENS = 32
GPU_TARGETS = ["sm_75", "sm_86", "sm_120"]
COMMON = {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
DECODER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip


def _families() -> dict[str, tuple[str, Callable[[], Any]]]:
    import transformers as t

    return {
        "llama": ("LlamaForCausalLM", lambda: t.LlamaConfig(**DECODER, **COMMON)),
        # a window of 8: the 12-token prompt and 32 new tokens run well past it
        "mistral": ("MistralForCausalLM", lambda: t.MistralConfig(**DECODER, sliding_window=8, **COMMON)),
        "gpt2": ("GPT2LMHeadModel", lambda: t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **COMMON)),
        "mixtral": (
            "MixtralForCausalLM",
            lambda: t.MixtralConfig(
                **DECODER, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **COMMON
            ),
        ),
    }


def save_checkpoint(family: str, directory: Path) -> Any:
    """A seeded random checkpoint, weights scaled up so that greedy choices are not near-ties."""
    import transformers

    architecture, make_config = _families()[family]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(make_config()).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.15)
    model.save_pretrained(str(directory))
    extra = {"experts_implementation": "batched_mm"} if family == "mixtral" else {}
    return getattr(transformers, architecture).from_pretrained(str(directory), **extra).eval()


def _prompts() -> tuple[np.ndarray, np.ndarray]:
    prompt = np.random.default_rng(0).integers(3, 256, (2, 12)).astype(np.int64)
    mask = np.ones_like(prompt)
    mask[1, :4] = 0  # the second prompt is 8 tokens, left padded
    return prompt, mask


def assert_greedy_tokens_match(reference: Any, artifact: Path, new_tokens: int = NEW_TOKENS,
                               kv_cache: str = "static") -> None:  # fmt: skip
    """The artifact's greedy tokens on ONNX Runtime equal transformers' for the left-padded prompts (EOS off),
    generated over the `kv_cache` layout (the default: static, updated in place)."""
    prompt, mask = _prompts()
    with torch.no_grad():
        expected = reference.generate(input_ids=torch.from_numpy(prompt), attention_mask=torch.from_numpy(mask),
                                      do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      eos_token_id=None, pad_token_id=0).numpy()  # fmt: skip
    with load(artifact, backend="onnxruntime") as model:
        assert model.manifest.generation is not None and model.manifest.generation.kv_cache == kv_cache
        assert np.array_equal(model.generate(prompt, mask, max_new_tokens=new_tokens, eos_token_id=[]), expected)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2", "mixtral"])
def test_generate_gives_transformers_tokens(family: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reference = save_checkpoint(family, tmp_path / "checkpoint")
    ada = ["sm_89"] if family == "llama" else []  # every architecture's static-cache engine, once
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu", *GPU_TARGETS, *ada]})
    with caplog.at_level(logging.INFO, logger="tensorsmith.compiler.early_engines"):
        manifest = compile(config, tmp_path / "out").manifest
    # the engines were started as soon as the fp16 variant was written, and taken: no build was made twice
    early = [record.getMessage() for record in caplog.records if record.name == "tensorsmith.compiler.early_engines"]
    assert any("beside its measurements" in message for message in early), early
    assert not any("built again" in message or "not started" in message for message in early), early
    assert not list((tmp_path / "out").glob(".early*"))
    assert manifest.generation is not None and manifest.generation.layers == 2
    for target in manifest.targets[1:]:  # fp16 by default for a decoder's GPU targets, two named profiles each
        assert target.status == "built" and target.variant == "fp16" and target.engine is not None, target.reason
        assert target.engine.profile_names == ["prefill", "decode"]
        prefill, decode = (profile["past_key_values.0.key"] for profile in target.engine.profiles)
        # the static cache, as long as the longest request (TensorRT takes a fixed size); a one-token prompt runs
        # in the decode profile
        assert prefill["min"][2] == decode["max"][2] == 256  # type: ignore[index]
        assert target.engine.profiles[0]["input_ids"]["min"][1] == 2  # type: ignore[index]
        assert target.engine.profiles[1]["input_ids"]["max"][1] == 1  # type: ignore[index]
    assert manifest.targets[0].variant == "fp32" and manifest.generation.kv_cache == "static"
    # GPT-2 ties its head to the embedding table: the engines' graph reads the table once (passes/tied_projection.py)
    tied = [(report.variant, report.counts) for report in manifest.passes if report.name == "tied_projection"]
    assert tied == [("fp16", {"projections_tied": 1 if family == "gpt2" else 0})]
    assert {r.name: r.shape for r in manifest.inputs if "past" not in r.name} == {
        "input_ids": ["batch", "sequence"], "attention_mask": ["batch", "cache"], "position_ids": ["batch", "sequence"],
        "write_indices": ["batch"]}  # fmt: skip
    prompt, mask = _prompts()
    ids, attention = torch.from_numpy(prompt), torch.from_numpy(mask)
    with torch.no_grad():
        greedy = reference.generate(input_ids=ids, attention_mask=attention, do_sample=False, max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0).numpy()  # fmt: skip
        with_eos = reference.generate(input_ids=ids, attention_mask=attention, do_sample=False,
                                      max_new_tokens=NEW_TOKENS, pad_token_id=0).numpy()  # fmt: skip
        beams = reference.generate(input_ids=ids[:1], do_sample=False, num_beams=4, max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0).numpy()  # fmt: skip
        positions = np.clip(mask.cumsum(1) - 1, 0, None)
        logits = reference(input_ids=ids, attention_mask=attention, position_ids=torch.from_numpy(positions)).logits
    logits = logits.numpy()
    with load(tmp_path / "out", backend="onnxruntime") as model:
        assert np.array_equal(model.generate(prompt, mask, max_new_tokens=NEW_TOKENS, eos_token_id=[]), greedy)
        assert np.array_equal(model.generate(prompt, mask, max_new_tokens=NEW_TOKENS), with_eos)
        assert np.array_equal(
            model.generate(prompt[:1], max_new_tokens=NEW_TOKENS, num_beams=4, eos_token_id=[]), beams
        )
        # a prefill run by hand: the static graph's cache is the prompt's length, written from slot 0
        empty = np.zeros((2, manifest.generation.kv_heads, 12, manifest.generation.head_dim), np.float32)
        pasts = [spec.name for spec in model.inputs if spec.name.startswith("past_key_values.")]
        feeds = {"input_ids": prompt, "attention_mask": mask, "position_ids": positions,
                 "write_indices": np.zeros(2, np.int64), **dict.fromkeys(pasts, empty)}  # fmt: skip
        prefill = model.run(feeds)["logits"]
    assert prefill.shape == (2, 1, 256)  # the last position's only
    assert max_relative_error(logits[:, -1:], prefill) <= 1e-4


@pytest.mark.slow
def test_sampling_is_reproducible_with_a_seed_and_streams(tmp_path: Path) -> None:
    save_checkpoint("llama", tmp_path / "checkpoint")
    compile(CompileConfig.create({"source": str(tmp_path / "checkpoint")}), tmp_path / "out")
    prompt, _ = _prompts()
    streamed: list[np.ndarray] = []
    with load(tmp_path / "out") as model:
        first = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=20, top_p=0.9, temperature=0.8,
                               seed=7, eos_token_id=[], streamer=streamed.append)  # fmt: skip
        second = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=20, top_p=0.9, temperature=0.8,
                                seed=7, eos_token_id=[])  # fmt: skip
        with pytest.raises(ValueError, match="leaves room for"):
            model.generate(prompt, max_new_tokens=400)
        # several threads on one loaded model: each request keeps its own cache
        alone = [model.generate(prompt[i : i + 1], max_new_tokens=16, eos_token_id=[]) for i in range(2)]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda i: model.generate(prompt[i % 2 : i % 2 + 1], max_new_tokens=16,
                                                              eos_token_id=[]), range(8)))  # fmt: skip
    assert all(np.array_equal(result, alone[i % 2]) for i, result in enumerate(together))
    assert np.array_equal(first, second) and first.shape == (2, 20)
    assert np.array_equal(np.stack(streamed, 1), first[:, 12:])


@pytest.mark.slow
def test_generation_lengths_shape_the_profiles_and_bound_requests(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    save_checkpoint("llama", tmp_path / "checkpoint")
    result = run_cli("compile", tmp_path / "checkpoint", "-o", tmp_path / "out", "--target", "sm_86",
                     "--max-sequence-length", "64", "--max-batch", "2")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    with load(tmp_path / "out", backend="onnxruntime") as model:
        assert model.manifest.generation is not None and model.manifest.generation.max_sequence_length == 64
        engine = model.manifest.targets[0].engine
        assert engine is not None
        prefill, decode = (profile["past_key_values.0.key"] for profile in engine.profiles)
        assert decode["max"] == prefill["max"] == [2, 2, 64, 16]  # the static cache, as long as a request
        prompt = np.ones((1, 60), np.int64)
        with pytest.raises(ValueError, match="leaves room for 4 new tokens"):
            model.generate(prompt, max_new_tokens=8)
        assert model.generate(prompt, max_new_tokens=4, eos_token_id=[]).shape == (1, 64)


@pytest.mark.slow
def test_the_generate_command_prints_tokens_and_timings(tmp_path: Path) -> None:
    import json

    from tests.conftest import run_cli

    save_checkpoint("gpt2", tmp_path / "checkpoint")
    compile(CompileConfig.create({"source": str(tmp_path / "checkpoint")}), tmp_path / "out")
    result = run_cli("generate", tmp_path / "out", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--json")
    assert result.exit_code == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["sequences"][0][:4] == [5, 6, 7, 8] and len(printed["new_tokens"]) == 6
    assert printed["text"] is None and printed["prefill_ms"] > 0 and printed["decode_tokens_per_second"] > 0
    refused = run_cli("generate", tmp_path / "out", "--prompt", "hello")
    assert refused.exit_code == 1 and "has no tokenizer" in refused.stderr


@pytest.mark.slow
def test_attention_fuses_except_for_an_fp32_gpu_engine(tmp_path: Path) -> None:
    """tinylm's attention becomes ONNX Attention (fp16 engines build it); fp32 on a GPU target keeps it decomposed,
    as TensorRT for RTX has no fp32 Attention kernel, and says so in the manifest."""
    checkpoint = Path(__file__).parents[2] / "samples" / "tinylm" / "checkpoint"
    for precision, fused in (("fp16", 4), ("fp32", 0)):
        config = CompileConfig.create({"source": str(checkpoint), "targets": ["cpu", "sm_86"], "precision": precision})
        manifest = compile(config, tmp_path / precision).manifest
        report = next(record for record in manifest.passes if record.name == "fuse_attention")
        assert report.counts.get("attention.matched", 0) == fused, report
        if not fused:
            assert report.counts == {"skipped": 1} and "fp32 on sm_86" in str(report.details["reason"])
        assert manifest.targets[1].status == "built", manifest.targets[1].reason
