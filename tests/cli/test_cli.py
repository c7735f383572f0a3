import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorsmith.cli.output import USAGE
from tests.conftest import cpu_backend, run_cli, run_cli_json


@pytest.mark.parametrize("command", [[], ["compile"], ["run"], ["inspect"]])
def test_every_command_has_help(command: list[str]) -> None:
    result = run_cli(*command, "--help")
    assert result.exit_code == 0
    assert "Usage:" in result.stdout


def test_compile_run_inspect_an_onnx_file(mlp_onnx: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    compiled = run_cli_json("compile", mlp_onnx, "--input", "x:float32:batch,8", "-o", out)
    assert compiled["ok"] is True
    assert compiled["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 8]}]
    assert compiled["outputs"] == [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]
    assert compiled["targets"][0]["name"] == "cpu"

    np.savez(tmp_path / "feeds.npz", x=np.ones((3, 8), np.float32))
    ran = run_cli_json("run", out, "--inputs", tmp_path / "feeds.npz", "--output", tmp_path / "outputs.npz")
    assert ran["backend"] == cpu_backend(out)
    assert ran["fallback_reason"].startswith("no CUDA device")
    assert ran["outputs"] == {"y": {"shape": [3, 4], "dtype": "float32"}}
    with np.load(tmp_path / "outputs.npz") as saved:
        assert saved["y"].shape == (3, 4)

    inspected = run_cli_json("inspect", out)
    assert inspected["kind"] == "artifact" and inspected["source"]["kind"] == "onnx"
    graph = run_cli_json("inspect", out / "model.onnx")
    assert graph["opset"] == 20 and graph["ops"]["Gemm"] == 2
    text = run_cli("inspect", out / "model.onnx")
    assert "opset 20" in text.stdout


def test_errors_are_one_line_with_a_hint_and_exit_1(tmp_path: Path) -> None:
    result = run_cli("compile", tmp_path / "missing.onnx", "-o", tmp_path / "out")
    assert result.exit_code == 1
    # stderr also carries progress lines (not a terminal here); the error itself is one line
    lines = [line for line in result.stderr.strip().splitlines() if "tensorsmith.progress" not in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "missing.onnx does not exist" in lines[0] and "(hint: " in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_errors_with_json_also_print_a_json_object(tmp_path: Path) -> None:
    result = run_cli("inspect", tmp_path / "nothing", "--json")
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and "nothing" in payload["error"] and payload["hint"]


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert run_cli("compile", "model.onnx").exit_code == 2  # no -o
    assert run_cli("run", tmp_path, "--inputs", "x.npz", "--backend", "tpu").exit_code == 2


def test_run_names_a_wrong_input(mlp_onnx: Path, tmp_path: Path) -> None:
    run_cli_json("compile", mlp_onnx, "--input", "x:float32:batch,8", "-o", tmp_path / "out")
    np.savez(tmp_path / "feeds.npz", x=np.ones((3, 8), np.float64))
    result = run_cli("run", tmp_path / "out", "--inputs", tmp_path / "feeds.npz")
    assert result.exit_code == 1
    assert "input 'x' has dtype float64, expected x:float32:[batch,8]" in result.stderr


def test_a_bad_input_flag_is_an_error(mlp_onnx: Path, tmp_path: Path) -> None:
    result = run_cli("compile", mlp_onnx, "--input", "x:float32", "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert "NAME:DTYPE:DIMS" in result.stderr


def test_fusion_runs_by_default_and_no_fuse_turns_it_off(mlp_onnx: Path, tmp_path: Path) -> None:
    """The MLP was exported at opset 14, where GELU is Div→Erf→Add→Mul→Mul."""
    fused = run_cli_json("compile", mlp_onnx, "-o", tmp_path / "fused")
    assert [p["name"] for p in fused["passes"]] == ["canonicalize", "fuse", "fold_attention_scale", "fuse_attention"]
    assert fused["passes"][1]["counts"]["gelu_erf.matched"] == 1
    assert run_cli_json("inspect", tmp_path / "fused" / "model.onnx")["ops"].get("Erf") is None

    plain = run_cli_json("compile", mlp_onnx, "--no-fuse", "-o", tmp_path / "plain")
    assert [p["name"] for p in plain["passes"]] == ["canonicalize"]
    assert run_cli_json("inspect", tmp_path / "plain" / "model.onnx")["ops"]["Erf"] == 1


def test_int8_compile_writes_variant_calibration_and_cache(mlp_onnx: Path, tmp_path: Path) -> None:
    samples = np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32)
    np.savez(tmp_path / "calibration.npz", x=samples)
    out = tmp_path / "out"
    compiled = run_cli_json(
        "compile", mlp_onnx, "--input", "x:float32:batch,8", "-o", out,
        "--precision", "int8", "--calibration", tmp_path / "calibration.npz", "--calibrator", "percentile",
        "--target", "cpu", "--target", "sm_86",
    )  # fmt: skip
    variants = {variant["name"]: variant for variant in compiled["variants"]}
    # The cpu runs int8 with fp32 around it; GPUs run int8 with fp16 around it (LayerNorm in fp32).
    assert variants["cpu-int8"]["path"] == "variants/cpu-int8.onnx"
    assert variants["cpu-int8"]["precisions"] == ["int8", "fp32"] and variants["int8"]["precisions"] == ["int8", "fp16"]
    for name in ("cpu-int8", "int8"):
        assert variants[name]["accuracy"]["cosine"] > 0.99
        assert variants[name]["evaluated_on"] == "10 calibration samples held out of calibration (the last of 40)"
    targets = {target["name"]: target for target in compiled["targets"]}
    assert targets["cpu"]["variant"] == "cpu-int8" and targets["cpu"]["status"] == "not-needed"
    assert targets["sm_86"]["status"] == "built" and (out / "engines" / "sm_86.engine").stat().st_size > 0
    assert json.loads((out / "engines" / "sm_86.json").read_text())["variant"] == "int8"

    table = json.loads((out / "calibration.json").read_text())
    assert table["method"] == "percentile" and table["samples"] == 30  # never evaluated on what calibrated
    plan = json.loads((out / "precision.json").read_text())["recipes"]["cpu-int8"]
    reasons = {layer["name"]: (layer["precision"], layer["reason"]) for layer in plan["layers"]}
    assert list(reasons.values()) == [
        ("int8", "--precision int8: every layer the policy allows"),
        ("fp32", "policy: final projection"),
    ]
    tensors = table["tensors"]
    assert all(t["int8_scale"] == pytest.approx(t["threshold"] / 127) for t in tensors.values())
    cache = (out / "calibration" / "int8.cache").read_text().splitlines()
    assert cache[0] == "TRT-101601-EntropyCalibration2"
    for line in cache[1:]:
        name, scale = line.split(": ")
        assert float(np.frombuffer(bytes.fromhex(scale)[::-1], np.float32)[0]) == pytest.approx(
            tensors[name]["int8_scale"]
        )

    from tensorsmith.runtime import load

    with load(out) as model:  # the cpu target runs its int8 variant on ONNX Runtime
        assert model.run({"x": samples[:3]})["y"].shape == (3, 4)


def test_fp8_for_an_ampere_target_is_refused_before_any_work(mlp_onnx: Path, tmp_path: Path) -> None:
    np.savez(tmp_path / "calibration.npz", x=np.ones((4, 8), np.float32))
    result = run_cli(
        "compile", mlp_onnx, "-o", tmp_path / "out", "--precision", "fp8",
        "--calibration", tmp_path / "calibration.npz", "--target", "sm_86",
    )  # fmt: skip
    assert result.exit_code == USAGE  # a combination the config refuses
    assert "target sm_86 (Ampere (RTX 30, A10)) cannot run fp8" in result.stderr
    assert "sm_89" in result.stderr
    assert not (tmp_path / "out").exists()


def test_turing_gets_an_fp16_variant_and_engine(mlp_onnx: Path, tmp_path: Path) -> None:
    compiled = run_cli_json(
        "compile", mlp_onnx, "--input", "x:float32:batch,8", "-o", tmp_path / "out",
        "--target", "cpu", "--target", "sm_75", "--target", "sm_86",
    )  # fmt: skip
    targets = {t["name"]: t for t in compiled["targets"]}
    assert targets["sm_75"]["variant"] == "fp16" and targets["sm_75"]["status"] == "built"
    assert targets["sm_86"]["variant"] == "fp32" and targets["cpu"]["variant"] == "fp32"
    fp16 = next(v for v in compiled["variants"] if v["name"] == "fp16")
    assert fp16["path"] == "variants/fp16.onnx" and fp16["accuracy"]["cosine"] > 0.999

    result = run_cli("compile", mlp_onnx, "-o", tmp_path / "cpu16", "--precision", "fp16")
    assert result.exit_code == USAGE and "target cpu" in result.stderr and "cannot run fp16" in result.stderr


def test_a_failed_engine_is_recorded_the_rest_is_written_and_the_exit_is_1(tmp_path: Path) -> None:
    """An ONNX file with an ONNX Runtime contrib op: ONNX Runtime runs it, TensorRT cannot parse it."""
    from onnx import TensorProto, helper, save

    node = helper.make_node("FastGelu", ["x"], ["y"], name="ort_fused_gelu", domain="com.microsoft")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
    )
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    save(helper.make_model(graph, opset_imports=opsets), str(tmp_path / "contrib.onnx"))
    result = run_cli(
        "compile", tmp_path / "contrib.onnx", "-o", tmp_path / "out", "--target", "cpu", "--target", "sm_86"
    )
    assert result.exit_code == 1
    assert "engine builds failed: sm_86" in result.stderr and "ort_fused_gelu" in result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    targets = {t["name"]: t for t in manifest["targets"]}
    assert targets["sm_86"]["status"] == "failed" and "FastGelu" in targets["sm_86"]["reason"]
    assert targets["cpu"]["status"] == "not-needed"


def test_every_command_has_json_output() -> None:
    from tensorsmith.cli.main import main

    for name, command in main.commands.items():
        assert "--json" in [opt for param in command.params for opt in getattr(param, "opts", [])], name


def test_progress_goes_to_stderr_as_plain_lines_when_not_a_terminal(mlp_onnx: Path, tmp_path: Path) -> None:
    result = run_cli("compile", mlp_onnx, "--input", "x:float32:batch,8", "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0
    json.loads(result.stdout)  # stdout stays one JSON object
    stages = [line for line in result.stderr.splitlines() if "tensorsmith.progress" in line]
    assert any("exporting" in line for line in stages) and any("running graph passes" in line for line in stages)


class Clamped(torch.nn.Module):
    """A clamp at float32's lowest value: in the fp16 variant, TensorRT for RTX warns about it, from native
    code, on file descriptor 1."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.clamp(x, min=torch.finfo(torch.float32).min))


def build_clamped() -> Clamped:
    torch.manual_seed(0)
    return Clamped()


def test_native_builder_output_is_logged_never_printed(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--json keeps stdout one JSON object, and no raw native line reaches the console, even when the builder
    prints from native code: the build's child process sends it to a file the compile logs, shown with -v."""
    source = "tests.cli.test_cli:build_clamped"
    args = ["compile", source, "--input", "x:float32:batch,8", "--target", "sm_75", "--json"]
    quiet = run_cli(*args, "-o", tmp_path / "quiet")
    assert quiet.exit_code == 0, quiet.stderr
    json.loads(quiet.stdout)
    captured = capfd.readouterr()
    assert "precision-lose casting" not in captured.out + captured.err + quiet.stdout + quiet.stderr
    verbose = run_cli("-v", *args, "-o", tmp_path / "verbose")
    assert verbose.exit_code == 0, verbose.stderr
    json.loads(verbose.stdout)
    (line,) = [line for line in verbose.stderr.splitlines() if "precision-lose casting" in line]
    assert "INFO tensorsmith.compiler.engines.isolated: building fp16.onnx for sm_75: WARNING:" in line, line


class WarnsWhileTraced(torch.nn.Module):
    """Warns from forward(), as model code and torch internals do while an exporter traces them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("this model warns while it is traced", UserWarning, stacklevel=1)
        return self.linear(x)


def build_warning_model() -> WarnsWhileTraced:
    return WarnsWhileTraced()


@pytest.mark.parametrize("verbose", [False, True])
def test_export_warnings_go_to_the_manifest_and_show_only_with_v(tmp_path: Path, verbose: bool) -> None:
    flags = ["-v"] if verbose else []
    result = run_cli(*flags, "compile", f"{__name__}:build_warning_model", "--input", "x:float32:batch,8",
                     "-o", tmp_path / "out")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "UserWarning: this model warns while it is traced" in manifest["source"]["warnings"]
    assert ("this model warns while it is traced" in result.stderr) is verbose


def test_a_misspelt_target_is_a_usage_error_with_the_closest_name(mlp_onnx: Path, tmp_path: Path) -> None:
    result = run_cli("compile", mlp_onnx, "-o", tmp_path / "out", "--target", "sm86")
    assert result.exit_code == USAGE
    assert "unknown target 'sm86' (hint: did you mean sm_86? targets are cpu, sm_75" in result.stderr
    assert not (tmp_path / "out").exists()
