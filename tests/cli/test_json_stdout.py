"""`--json` prints one JSON object on stdout, as a user's shell sees it (a child process): the libraries'
own log lines (onnx-graphsurgeon's, Polygraphy's) go to Python logging, shown with -v only. Checkpoints as
transformers initialises them (exporters store equal weights once: zero biases, unit norms) and as trained ones
are (two LayerNorms of one residual stream) give fp16 variants that onnx's checker and ONNX Runtime take."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from tensorsmith.core.sessions import run_onnx
from tests.compiler.test_decoders import COMMON, DECODER

TENSORSMITH = str(Path(sys.executable).with_name("tensorsmith"))


def compile_json(source: Path, out: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """`tensorsmith compile SOURCE -o OUT FLAGS --json` in its own process: the parsed stdout, and stderr."""
    command = [TENSORSMITH, "compile", str(source), "-o", str(out), *flags, "--json"]
    process = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        payload = json.loads(process.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON object:\n{process.stdout[:2000]}\nstderr:\n{process.stderr[-2000:]}")
    assert process.returncode == 0, payload
    assert "distinct tensors" not in process.stderr, process.stderr  # nor shown without -v
    return payload, process.stderr


def _save(model: Any, directory: Path, norms: bool) -> Path:
    """Weight matrices scaled up as in test_decoders; biases left as transformers initialises them (zeros), and
    with `norms` the LayerNorm scales moved off their ones (each norm then differs, as trained ones do)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.15)
            elif norms and "layernorm.weight" in name:
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
    model.save_pretrained(str(directory))
    return directory


def gpt_neox(directory: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=256, **COMMON)  # fmt: skip
    return _save(transformers.GPTNeoXForCausalLM(config).eval(), directory, norms=True)


@pytest.mark.slow
def test_gpt_neox_for_a_gpu_prints_json_and_writes_a_valid_fp16_variant(tmp_path: Path) -> None:
    compiled, _ = compile_json(gpt_neox(tmp_path / "neox"), tmp_path / "out", "--target", "sm_86")
    (target,) = compiled["targets"]
    assert compiled["ok"] and target["status"] == "built" and target["variant"] == "fp16", target
    path = tmp_path / "out" / "variants" / "fp16.onnx"
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)  # in topological order, types that agree
    ids = np.random.default_rng(0).integers(3, 256, (1, 6)).astype(np.int64)
    # an engine's static cache, as long as the longest request, fp16; the prompt written from slot 0
    length = compiled["generation"]["max_sequence_length"]
    mask = np.zeros((1, length), np.int64)
    mask[:, :6] = 1
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.arange(6)[None],
             "write_indices": np.zeros(1, np.int64)}  # fmt: skip
    for spec in compiled["inputs"]:
        if spec["name"].startswith("past_key_values."):
            feeds[spec["name"]] = np.zeros((1, 4, length, 16), np.float16)
    (logits, *_) = run_onnx(path, feeds)
    assert logits.shape == (1, 1, 256) and np.isfinite(logits).all()


@pytest.mark.slow
def test_qwen2_with_its_zero_biases_prints_json_for_the_cpu(tmp_path: Path) -> None:
    """Its q, k and v biases start as zeros, which the exporter stores once for every layer: folding attention's
    scale into each layer's q bias makes one copy per layer, each of its own name."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**DECODER, **COMMON)
    checkpoint = _save(transformers.Qwen2ForCausalLM(config).eval(), tmp_path / "qwen2", norms=False)
    compiled, _ = compile_json(checkpoint, tmp_path / "out", "--target", "cpu")
    fold = next(record for record in compiled["passes"] if record["name"] == "fold_attention_scale")
    assert fold["counts"]["attention_scale.matched"] == 2
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    scaled = [init.name for init in model.graph.initializer if "attention_scaled" in init.name]
    assert len(scaled) == len(set(scaled)) >= 2


def test_graphsurgeon_logs_through_logging_not_stdout(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from onnx_graphsurgeon.logger import G_LOGGER

    import tensorsmith.passes  # noqa: F401  (routes onnx-graphsurgeon's logger, as every pass module does)

    with caplog.at_level(logging.INFO, logger="onnx_graphsurgeon"):
        G_LOGGER.warning("a graph warning")
        with G_LOGGER.suppress():
            G_LOGGER.warning("a suppressed warning")
    assert capsys.readouterr().out == ""
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, "a graph warning")]


def test_polygraphy_logs_through_logging_not_stdout(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from polygraphy.logger import G_LOGGER

    from tensorsmith.core.library_logs import route_polygraphy_logs

    route_polygraphy_logs()  # as canonicalize does before Polygraphy's folding loop
    with caplog.at_level(logging.INFO, logger="Polygraphy"):
        G_LOGGER.info("a folding pass")  # below its warnings: dropped
        G_LOGGER.warning("a folding warning")
    assert capsys.readouterr().out == ""
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, "a folding warning")]
