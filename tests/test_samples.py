"""Every sample compiles with `tensorsmith compile samples/NAME/tensorsmith.toml`, matches PyTorch, and its fused
graph builds with TensorRT for RTX for SM86."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import profile_for
from tensorsmith.runtime import load
from tensorsmith.runtime.manifest import read_manifest
from tensorsmith.samples import prepare
from tests.conftest import max_relative_error, run_cli_json
from tests.report_rendering import check_report_renders

SAMPLES = Path(prepare.__file__).resolve().parent
TOLERANCE = 1e-4  # max |difference| relative to the output's scale


def tiny_bert() -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    from safetensors.torch import load_file

    from tensorsmith.samples.tiny_bert.model import build

    module = build()
    module.load_state_dict(load_file(str(SAMPLES / "tiny_bert" / "weights.safetensors")))
    rng = np.random.default_rng(7)
    mask = np.ones((3, 10), np.int64)
    mask[1, 6:] = 0  # one padded sequence
    return module, {"input_ids": rng.integers(0, 1000, (3, 10)), "attention_mask": mask}


def cnn() -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    from tensorsmith.samples.cnn.model import build

    module = build()
    module.load_state_dict(torch.load(SAMPLES / "cnn" / "weights.pt", weights_only=True))
    images = np.random.default_rng(7).standard_normal((3, 3, 32, 32)).astype(np.float32)
    return module, {"images": images}


def moe() -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    from tensorsmith.samples.moe.model import build

    hidden = np.random.default_rng(7).standard_normal((3, 10, 64)).astype(np.float32)
    return build(), {"hidden_states": hidden}


def minilm() -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    from tensorsmith.samples.minilm.model import build

    with np.load(SAMPLES / "minilm" / "evaluation.npz") as held_out:
        feeds = {name: held_out[name][:16] for name in held_out.files}
    return build(), feeds


CASES: dict[str, Callable[[], tuple[torch.nn.Module, dict[str, np.ndarray]]]] = {
    "tiny_bert": tiny_bert,
    "cnn": cnn,
    "moe": moe,
    "minilm": minilm,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_sample_compiles_and_matches_pytorch(name: str, tmp_path: Path) -> None:
    prepare.prepare(name)
    compiled = run_cli_json("compile", SAMPLES / name / "tensorsmith.toml", "-o", tmp_path / name)
    assert compiled["source"]["exporter"] == "dynamo"

    module, feeds = CASES[name]()
    with torch.inference_mode():
        expected = module.eval()(*(torch.from_numpy(array) for array in feeds.values()))
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)

    with load(tmp_path / name) as model:
        outputs = model.run(feeds)
    assert len(outputs) == len(expected)
    for (output_name, actual), reference in zip(outputs.items(), expected, strict=True):
        assert actual.shape == tuple(reference.shape), output_name
        assert max_relative_error(reference.numpy(), actual) < TOLERANCE, output_name

    passes = [record["name"] for record in compiled["passes"]]
    assert passes == ["canonicalize", "fuse", "fold_attention_scale", "fuse_attention"]
    check_report_renders(tmp_path / name, tmp_path, quantized=False)
    manifest = read_manifest(tmp_path / name)
    config = CompileConfig.from_toml(SAMPLES / name / "tensorsmith.toml")
    engine = build_engine(tmp_path / name / "model.onnx", "sm_86", profile_for(manifest.inputs, config.dims))
    assert engine.builder == "tensorrt-rtx" and len(engine.plan) > 0


@pytest.mark.slow
def test_minilm_from_torchscript_opset_14_fuses_to_standard_ops(tmp_path: Path) -> None:
    """An 'old' ONNX file: the real MiniLM through the TorchScript exporter at opset 14 (decomposed LayerNorm
    and GELU), compiled as an ONNX source."""
    import onnx
    import onnxruntime

    module, feeds = minilm()
    old = tmp_path / "minilm-opset14.onnx"
    names = ["input_ids", "attention_mask"]
    torch.onnx.export(
        module, tuple(torch.from_numpy(feeds[n][:2]) for n in names), str(old), dynamo=False, opset_version=14,
        input_names=names, output_names=["token_embeddings", "sentence_embedding"],
        dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names},
    )  # fmt: skip
    # As a user runs it, in its own process: stderr holds tensorsmith's own lines only (no ONNX Runtime optimizer
    # notes, no library warnings), and stdout the JSON.
    command = [str(Path(sys.executable).with_name("tensorsmith")), "compile", str(old), "-o", str(tmp_path / "out")]
    process = subprocess.run([*command, "--json"], capture_output=True, text=True, check=True)
    ours = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (INFO|WARNING) tensorsmith[.\w]*: ")
    assert process.stderr.strip() and all(ours.match(line) for line in process.stderr.splitlines()), process.stderr
    compiled = json.loads(process.stdout)
    fuse = next(record for record in compiled["passes"] if record["name"] == "fuse")
    assert fuse["counts"]["layernorm.matched"] == 13
    assert fuse["counts"]["gelu_erf.matched"] == 6

    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("LayerNormalization") == 13 and ops.count("Gelu") == 6
    assert "ReduceMean" not in ops and "Erf" not in ops

    unfused = onnxruntime.InferenceSession(str(old), providers=["CPUExecutionProvider"]).run(None, feeds)
    with load(tmp_path / "out") as compiled_model:
        outputs = list(compiled_model.run(feeds).values())
    for reference, actual in zip(unfused, outputs, strict=True):
        assert max_relative_error(reference, actual) < TOLERANCE

    dims = {"batch": {"opt": 8, "max": 64}, "sequence": {"opt": 64, "max": 512}}
    config = CompileConfig.create({"source": str(old), "dims": dims})
    manifest = read_manifest(tmp_path / "out")
    assert len(build_engine(tmp_path / "out" / "model.onnx", "sm_86", profile_for(manifest.inputs, config.dims)).plan)


@pytest.mark.slow
def test_tinylm_compiles_and_generates_what_transformers_generates(tmp_path: Path) -> None:
    """The real decoder sample (trained on CPython's own text): compiled from its checkpoint directory, its
    greedy continuation of a held-out passage equals transformers' token for token, and the text reads back."""
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    sample = Path(prepare.SAMPLES) / "tinylm"
    out = tmp_path / "tinylm"
    result = run_cli_json("compile", sample / "tensorsmith.toml", "-o", out)
    assert [t["name"] for t in result["targets"] if t["status"] == "built"] == ["sm_86"]
    assert {r["path"] for r in result["tokenizer"]} >= {"tokenizer/tokenizer.json"}

    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    prompt = np.array([tokenizer.encode((sample / "heldout.txt").read_text()[:400]).ids[:48]], np.int64)
    reference = LlamaForCausalLM.from_pretrained(str(sample / "checkpoint")).eval()
    with torch.no_grad():
        ids = torch.from_numpy(prompt)
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                      pad_token_id=0).numpy()  # fmt: skip
    with load(out) as model:
        generated = model.generate(prompt, max_new_tokens=32)
    assert np.array_equal(generated, expected)
    printed = run_cli_json("generate", out, "--prompt", "The with statement", "--max-new-tokens", "12")
    assert printed["text"] and printed["text"] == tokenizer.decode(printed["new_tokens"])

    # Perplexity on the held-out text: the fp32 graph's is transformers' own; fp16 loses next to nothing.
    variants = {variant["name"]: variant["accuracy"] for variant in result["variants"]}
    ids = tokenizer.encode((sample / "heldout.txt").read_text()).ids
    windows = torch.tensor([ids[i * 128 : (i + 1) * 128] for i in range(64)])  # text_data.EVALUATION_WINDOWS
    with torch.no_grad():
        loss = reference(input_ids=windows, labels=windows).loss.item()
    assert abs(variants["fp32"]["perplexity"] / np.exp(loss) - 1) < 1e-4
    assert variants["fp16"]["perplexity-ratio"] < 1.01 and variants["fp16"]["next-token-agreement"] > 0.97
