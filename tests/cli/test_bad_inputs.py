"""Bad inputs to `tensorsmith compile` and `tensorsmith generate`, one row each: exit 1, one line on stderr naming
the thing with a hint (under --json, a JSON error with the hint), no traceback, and nothing written (no OUT, no
temporary directory left beside it)."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import Result
from onnx import TensorProto, helper
from safetensors.torch import save_file

from tensorsmith import runtime
from tensorsmith.cli.output import USAGE
from tensorsmith.compiler import pipeline
from tests.conftest import run_cli, small_mlp_onnx

MLP_INPUT = ["--input", "x:float32:batch,8"]
TINYLM = Path(__file__).parents[2] / "samples" / "tinylm" / "checkpoint"


class Payload:
    """Unpickling this would run code; a weights-only load must refuse it."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("arbitrary code ran",))


def mlp_factory() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


FACTORY = "tests.cli.test_bad_inputs:mlp_factory"


def single_node_onnx(path: Path, op: str, opset: int) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="the_node")], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.save(model, str(path))
    return path


def calibration(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def ok_batch(rows: int = 8) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((rows, 8)).astype(np.float32)


Case = Callable[[Path], list[str]]


def missing_file(tmp: Path) -> list[str]:
    return [str(tmp / "nowhere.onnx")]


def truncated_onnx(tmp: Path) -> list[str]:
    data = small_mlp_onnx(tmp / "mlp.onnx").read_bytes()
    (tmp / "truncated.onnx").write_bytes(data[: len(data) // 2])
    return [str(tmp / "truncated.onnx")]


def corrupt_onnx(tmp: Path) -> list[str]:
    (tmp / "corrupt.onnx").write_bytes(b"\x08\x07this is not protobuf\xff\xfe" * 10)
    return [str(tmp / "corrupt.onnx")]


def unknown_op(tmp: Path) -> list[str]:
    return [str(single_node_onnx(tmp / "op.onnx", "FrobnicateAll", 17))]


def unknown_opset(tmp: Path) -> list[str]:
    return [str(single_node_onnx(tmp / "opset.onnx", "Relu", 99))]


def config_unknown_key(tmp: Path) -> list[str]:
    (tmp / "tensorsmith.toml").write_text(f'source = "{FACTORY}"\ncolour = "red"\n')
    return [str(tmp / "tensorsmith.toml")]


def config_unknown_table(tmp: Path) -> list[str]:
    (tmp / "tensorsmith.toml").write_text('[model]\nsource = "x.onnx"\nbogus_key = 3\n')
    return [str(tmp / "tensorsmith.toml")]


def config_wrong_type(tmp: Path) -> list[str]:
    (tmp / "tensorsmith.toml").write_text(f'source = "{FACTORY}"\nopset = "twenty"\n')
    return [str(tmp / "tensorsmith.toml")]


def factory_does_not_import(tmp: Path) -> list[str]:
    return ["tests.no_such_module:build", *MLP_INPUT]


def checkpoint_missing_and_unexpected_keys(tmp: Path) -> list[str]:
    state = mlp_factory().state_dict()
    state.pop("2.bias")
    state["9.weight"] = torch.zeros(1)
    save_file(state, str(tmp / "w.safetensors"))
    return [FACTORY, "--checkpoint", str(tmp / "w.safetensors"), *MLP_INPUT]


def checkpoint_shape_mismatch(tmp: Path) -> list[str]:
    state = mlp_factory().state_dict()
    state["0.weight"] = torch.zeros(5, 8)
    save_file(state, str(tmp / "w.safetensors"))
    return [FACTORY, "--checkpoint", str(tmp / "w.safetensors"), *MLP_INPUT]


def pickle_with_objects(tmp: Path) -> list[str]:
    with (tmp / "evil.pt").open("wb") as stream:
        pickle.dump({"0.weight": Payload()}, stream)
    return [FACTORY, "--checkpoint", str(tmp / "evil.pt"), *MLP_INPUT]


def quantize(tmp: Path, data: Path) -> list[str]:
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), *MLP_INPUT, "--precision", "int8", "--calibration", str(data)]


def calibration_wrong_names(tmp: Path) -> list[str]:
    return quantize(tmp, calibration(tmp / "c.npz", images=ok_batch()))


def calibration_wrong_dtype(tmp: Path) -> list[str]:
    return quantize(tmp, calibration(tmp / "c.npz", x=ok_batch().astype(np.float64)))


def calibration_wrong_shape(tmp: Path) -> list[str]:
    return quantize(tmp, calibration(tmp / "c.npz", x=np.zeros((8, 7), np.float32)))


def calibration_all_nan(tmp: Path) -> list[str]:
    return quantize(tmp, calibration(tmp / "c.npz", x=np.full((8, 8), np.nan, np.float32)))


def calibration_no_samples(tmp: Path) -> list[str]:
    return quantize(tmp, calibration(tmp / "c.npz", x=np.zeros((0, 8), np.float32)))


def calibration_missing(tmp: Path) -> list[str]:
    return quantize(tmp, tmp / "nowhere.npz")


def unknown_target(tmp: Path) -> list[str]:
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), *MLP_INPUT, "--target", "sm_99"]


def float64_input_onnx(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["batch", 8])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def input_dtype_unsupported(tmp: Path) -> list[str]:
    return [str(float64_input_onnx(tmp / "f64.onnx"))]


def input_not_in_file(tmp: Path) -> list[str]:
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), "--input", "images:float32:batch,8"]


def input_wrong_rank(tmp: Path) -> list[str]:
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), "--input", "x:float32:batch"]


def input_zero_dim(tmp: Path) -> list[str]:
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), "--input", "x:float32:0,8"]


def dims_name_no_dim(tmp: Path) -> list[str]:
    small_mlp_onnx(tmp / "mlp.onnx")
    (tmp / "tensorsmith.toml").write_text('source = "mlp.onnx"\n[dims.batchsize]\nmax = 4\n')
    return [str(tmp / "tensorsmith.toml")]


def evaluation_wrong_names(tmp: Path) -> list[str]:
    args = quantize(tmp, calibration(tmp / "c.npz", x=ok_batch()))
    return [*args, "--eval-data", str(calibration(tmp / "e.npz", images=ok_batch()))]


def calibration_wrong_rank(tmp: Path) -> list[str]:
    return quantize(tmp, calibration(tmp / "c.npz", x=np.zeros((8, 8, 1), np.float32)))


def precision_not_on_target(tmp: Path) -> list[str]:
    args = quantize(tmp, calibration(tmp / "c.npz", x=ok_batch()))
    return [*args[:-4], "--precision", "fp8", "--calibration", args[-1], "--target", "sm_86"]


def op_onnxruntime_cannot_run(tmp: Path) -> list[str]:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    node = helper.make_node("Frobnicate", ["x"], ["y"], name="custom_node", domain="com.example")
    graph = helper.make_graph([node], "g", [x], [y])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(tmp / "custom.onnx"))
    return [str(tmp / "custom.onnx")]


def generation_for_no_decoder(tmp: Path) -> list[str]:
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), "--max-sequence-length", "64"]


def malformed_budget(tmp: Path) -> list[str]:
    data = calibration(tmp / "c.npz", x=ok_batch())
    return [*quantize(tmp, data)[:-4], "--precision", "auto", "--calibration", str(data), "--budget", "cosine>>1"]


def language_budget_for_no_decoder(tmp: Path) -> list[str]:
    data = calibration(tmp / "c.npz", x=ok_batch())
    return [*quantize(tmp, data)[:-4], "--precision", "auto", "--calibration", str(data),
            "--budget", "perplexity-ratio<=1.03"]  # fmt: skip


def _tinylm_without_tokenizer(tmp: Path) -> Path:
    checkpoint = tmp / "tinylm"
    shutil.copytree(TINYLM, checkpoint, ignore=shutil.ignore_patterns("tokenizer*"))
    return checkpoint


def decoder_text_without_tokenizer(tmp: Path) -> list[str]:
    (tmp / "calibration.txt").write_text("def f(x):\n    return x\n" * 100)
    checkpoint = _tinylm_without_tokenizer(tmp)
    return [str(checkpoint), "--precision", "int8", "--calibration", str(tmp / "calibration.txt")]


def decoder_text_too_short(tmp: Path) -> list[str]:
    (tmp / "short.txt").write_text("Too short.")
    return [str(TINYLM), "--precision", "int8", "--calibration", str(tmp / "short.txt")]


def int4_awq_without_data(tmp: Path) -> list[str]:
    return [str(TINYLM), "--precision", "int4"]


def int4_low_opset(tmp: Path) -> list[str]:
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), "--precision", "int4", "--int4-algorithm", "rtn", "--opset", "20"]


def weight_only_override_for_int8(tmp: Path) -> list[str]:
    config = tmp / "tensorsmith.toml"
    config.write_text(f'source = "{small_mlp_onnx(tmp / "mlp.onnx")}"\nprecision = "int8"\n'
                      f'calibration = "{tmp / "c.npz"}"\n[[overrides]]\nmatch = "*"\nprecision = "int4"\n')  # fmt: skip
    np.savez(tmp / "c.npz", x=np.ones((4, 8), np.float32))
    return [str(config)]


def calibration_stats_and_data(tmp: Path) -> list[str]:
    np.savez(tmp / "c.npz", x=np.ones((4, 8), np.float32))
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), "--precision", "int8", "--calibration", str(tmp / "c.npz"),
            "--calibration-stats", str(tmp / "stats" / "*.npz"), "--eval-data", str(tmp / "c.npz")]  # fmt: skip


def calibration_stats_without_eval_data(tmp: Path) -> list[str]:
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), "--precision", "int8", "--calibration-stats",
            str(tmp / "stats" / "*.npz")]  # fmt: skip


def source_path_missing(tmp: Path) -> list[str]:
    return [str(tmp / "hf" / "does_not_exist")]  # no ':', so a path: not a factory without declared inputs


def decoder_calibration_python_file(tmp: Path) -> list[str]:
    (tmp / "calibrate.py").write_text("print('calibration')\n")
    return [str(TINYLM), "--precision", "int8", "--calibration", str(tmp / "calibrate.py")]


def encoder_calibration_text(tmp: Path) -> list[str]:
    (tmp / "calibration.txt").write_text("Some sentences to calibrate on.\n" * 100)
    return quantize(tmp, tmp / "calibration.txt")


def encoder_evaluation_text(tmp: Path) -> list[str]:
    (tmp / "evaluation.txt").write_text("Some sentences to evaluate on.\n" * 100)
    return [str(small_mlp_onnx(tmp / "mlp.onnx")), *MLP_INPUT, "--eval-data", str(tmp / "evaluation.txt")]


def t5_directory(tmp: Path) -> list[str]:
    import transformers

    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4)
    transformers.T5ForConditionalGeneration(config).save_pretrained(str(tmp / "t5"))
    return [str(tmp / "t5")]


def mamba_directory(tmp: Path) -> list[str]:
    import transformers

    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4)
    transformers.MambaForCausalLM(config).save_pretrained(str(tmp / "mamba"))
    return [str(tmp / "mamba")]


def factory_export_fails(tmp: Path) -> list[str]:
    return [FACTORY, "--input", "x:float32:batch,7"]  # its first Linear takes 8 features


def directory_export_fails(tmp: Path) -> list[str]:
    """A GPT-2 directory whose config.json gives a head_dim its layers do not use (GPT-2 divides n_embd by n_head):
    the past tensors are declared with it, as Falcon's once were with too many heads, and do not fit the cache."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp / "gpt2"))
    written = json.loads((tmp / "gpt2" / "config.json").read_text())
    (tmp / "gpt2" / "config.json").write_text(json.dumps({**written, "head_dim": 4}))
    return [str(tmp / "gpt2"), "--target", "cpu"]


# a directory transformers builds but the export cannot take: the line names it and what tensorsmith compiles
COMPILES = (
    "tensorsmith compiles transformer families' decoders (*ForCausalLM, *LMHeadModel), encoders (*Model) and heads"
)
MAMBA = "MambaForCausalLM, a model with state-space or recurrent layers (model_type 'mamba'); "
BEFORE, AFTER = True, False  # fails before the export and the passes start / can only fail during them
CASES: dict[str, tuple[Case, str, bool]] = {
    "missing file": (missing_file, "nowhere.onnx", BEFORE),
    "truncated onnx": (truncated_onnx, "truncated.onnx", BEFORE),
    "corrupt onnx": (corrupt_onnx, "corrupt.onnx", BEFORE),
    "unknown op": (unknown_op, "uses op 'FrobnicateAll'", BEFORE),
    "op onnxruntime cannot run": (op_onnxruntime_cannot_run, "com.example:Frobnicate", AFTER),
    "unknown opset": (unknown_opset, "opset 99", BEFORE),
    "config unknown key": (config_unknown_key, "unknown key 'colour'", BEFORE),
    "config unknown table": (config_unknown_table, "unknown table 'model'", BEFORE),
    "config wrong type": (config_wrong_type, "opset", BEFORE),
    "factory does not import": (factory_does_not_import, "tests.no_such_module", AFTER),
    "checkpoint keys": (checkpoint_missing_and_unexpected_keys, "missing keys: 2.bias", AFTER),
    "checkpoint shapes": (checkpoint_shape_mismatch, "0.weight (5, 8) vs (16, 8)", AFTER),
    "pickle with objects": (pickle_with_objects, "refuses to unpickle", AFTER),
    "input dtype unsupported": (input_dtype_unsupported, "input 'x' of", BEFORE),
    "input not in the file": (input_not_in_file, "has no input 'images'", BEFORE),
    "input wrong rank": (input_wrong_rank, "has rank 2, declared x:float32:batch", BEFORE),
    "input zero dim": (input_zero_dim, "static dim 0 of input 'x'", BEFORE),
    "dims name no dim": (dims_name_no_dim, "[dims.batchsize] names no dynamic dim", BEFORE),
    "calibration names": (calibration_wrong_names, "images", BEFORE),
    "calibration dtype": (calibration_wrong_dtype, "array 'x' is float64", BEFORE),
    "calibration shape": (calibration_wrong_shape, "array 'x' has size 7 on axis 1", BEFORE),
    "calibration rank": (calibration_wrong_rank, "array 'x'", BEFORE),
    "calibration all nan": (calibration_all_nan, "array 'x' holds no finite value", BEFORE),
    "calibration no samples": (calibration_no_samples, "holds no samples", BEFORE),
    "calibration missing": (calibration_missing, "nowhere.npz", BEFORE),
    "evaluation names": (evaluation_wrong_names, "images", BEFORE),
    "unknown target": (unknown_target, "sm_99", BEFORE),
    "precision not on target": (precision_not_on_target, "fp8", BEFORE),
    "malformed budget": (malformed_budget, "cosine>>1", BEFORE),
    "generation for no decoder": (generation_for_no_decoder, "[generation] is for decoders", BEFORE),
    "language budget for no decoder": (language_budget_for_no_decoder, "is a language-model metric", BEFORE),
    "decoder text without tokenizer": (decoder_text_without_tokenizer, "has no tokenizer.json", BEFORE),
    "decoder text too short": (decoder_text_too_short, "fewer than one window of 128", BEFORE),
    "int4 awq without data": (int4_awq_without_data, "int4 with awq needs calibration data", BEFORE),
    "int4 below opset 21": (int4_low_opset, "needs opset 21", BEFORE),
    "weight-only override for int8": (weight_only_override_for_int8, "int4 pins weight layers", BEFORE),
    "calibration stats and data": (calibration_stats_and_data, "--calibration-stats stands in for", BEFORE),
    "calibration stats, no eval data": (calibration_stats_without_eval_data, "needs --eval-data", BEFORE),
    "source path missing": (source_path_missing, "hf/does_not_exist does not exist", BEFORE),
    "decoder calibration .py": (decoder_calibration_python_file, "calibrate.py is a .py file; the decoder", BEFORE),
    "encoder calibration .txt": (encoder_calibration_text, "calibration.txt is a .txt file", BEFORE),
    "encoder evaluation .txt": (encoder_evaluation_text, "evaluation.txt is a .txt file", BEFORE),
    "t5 directory": (t5_directory, "T5ForConditionalGeneration, an encoder-decoder model; " + COMPILES, BEFORE),
    "mamba directory": (mamba_directory, MAMBA + COMPILES, BEFORE),
    # the exporters' own causes, not the dynamo exporter's "… Next steps:"
    "factory export fails": (factory_export_fails, "dynamo: RuntimeError: a and b must have same reduction dim", AFTER),
    "directory export fails": (directory_export_fails, "dynamo: RuntimeError: Sizes of tensors must match", AFTER),
}


# what the config's own checks refuse (a key, value or combination it does not take): a usage error
USAGE_CASES = {
    "config unknown key",
    "config unknown table",
    "config wrong type",
    "unknown target",
    "input zero dim",
    "precision not on target",
    "int4 awq without data",
    "malformed budget",
    "int4 below opset 21",
    "weight-only override for int8",
    "calibration stats and data",
    "calibration stats, no eval data",
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clear_line_and_nothing_is_written(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    make, expected, before = CASES[case]
    scratch = tmp_path / "inputs"
    scratch.mkdir()
    arguments = make(scratch)
    out = tmp_path / "artifacts" / "out"
    if before:  # the export (or an ONNX source's passes) must not start: it is where the slow work begins
        monkeypatch.setattr(pipeline, "fused_graph", _no_export)
    result = run_cli("compile", *arguments, "-o", out)
    code = USAGE if case in USAGE_CASES else 1
    assert_one_clear_line(result, expected, code)
    assert_json_error(run_cli("compile", *arguments, "-o", out, "--json"), expected, code)
    assert not out.exists()
    assert not (tmp_path / "artifacts").exists() or not any((tmp_path / "artifacts").iterdir())
    assert "arbitrary code ran" not in capsys.readouterr().out + result.stdout
    assert "weights_only=False" not in result.stderr and "pydantic" not in result.stderr


def assert_one_clear_line(result: Result, expected: str, code: int = 1) -> None:
    """Exit `code` and one `error: ...` line on stderr naming the thing, with a hint; no traceback."""
    assert result.exit_code == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0] and "(hint: " in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def assert_json_error(result: Result, expected: str, code: int = 1) -> None:
    """Under --json: exit `code` and one JSON object on stdout, the error naming the thing and a hint with it."""
    assert result.exit_code == code, result.stderr
    printed = json.loads(result.stdout)
    assert printed["ok"] is False and expected in printed["error"], printed
    assert printed["hint"], printed


def _no_export(*args: object) -> None:
    raise AssertionError("the export started before the bad input was found")


# `tensorsmith generate` on the session's tinylm artifact (vocabulary 2048, 512 positions): bad settings and ids
# are one clear line, found before the artifact is loaded.
GENERATE_CASES: dict[str, tuple[list[str], str]] = {
    "negative max new tokens": (["--max-new-tokens", "-5"], "max_new_tokens is -5"),
    "zero max new tokens": (["--max-new-tokens", "0"], "max_new_tokens is 0"),
    "zero beams": (["--num-beams", "0"], "num_beams is 0"),
    "top p above 1": (["--top-p", "2"], "top_p is 2.0"),
    "top p zero": (["--top-p", "0"], "top_p is 0.0"),
    "negative top k": (["--top-k", "-1"], "top_k is -1"),
    "sampling at temperature 0": (["--do-sample", "--temperature", "0"], "temperature is 0.0"),
    "negative temperature": (["--temperature", "-1"], "temperature is -1.0"),
    "negative seed": (["--do-sample", "--seed", "-3"], "seed is -3"),
    "sampling beams": (["--do-sample", "--num-beams", "2"], "beam sampling is not supported"),
    "id above the vocabulary": (
        ["--prompt-ids", "1,99999"],
        "input_ids[0, 1] is 99999, outside the vocabulary of 2048",
    ),
    "negative id": (["--prompt-ids", "-1,5"], "input_ids[0, 0] is -1"),
    "past the max sequence length": (["--max-new-tokens", "600"], "leaves room for 509 new tokens, not 600"),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_bad_generate_arguments_are_one_clear_line_before_the_load(
    case: str, tinylm_cpu_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arguments, expected = GENERATE_CASES[case]
    if "--prompt-ids" not in arguments:
        arguments = ["--prompt-ids", "1,2,3", *arguments]
    monkeypatch.setattr(runtime, "load", _no_load)  # the checks read the manifest only
    assert_one_clear_line(run_cli("generate", tinylm_cpu_artifact, *arguments), expected)
    assert_json_error(run_cli("generate", tinylm_cpu_artifact, *arguments, "--json"), expected)


def _no_load(*args: object, **kwargs: object) -> None:
    raise AssertionError("the artifact was loaded before the bad argument was found")
