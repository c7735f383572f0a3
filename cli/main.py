"""The `tensorsmith` command. Each command parses flags, calls one library function, and prints."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.table import Table

from tensorsmith.cli.output import RichReporter, emit_json, handle_errors, setup_logging, stderr, stdout
from tensorsmith.runtime.errors import TensorsmithError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug); tracebacks on errors.")
@click.version_option(package_name="tensorsmith")
def main(verbose: int) -> None:
    """tensorsmith: compile PyTorch and ONNX models into per-architecture TensorRT engines."""
    setup_logging(verbose)


@contextlib.contextmanager
def _reporter() -> Iterator[Any]:
    """Rich progress (stages and counted tasks) on a terminal; plain log lines on stderr otherwise (a CI log)."""
    if stderr.is_terminal:
        with RichReporter(stderr) as reporter:
            yield reporter
    else:
        yield None


@main.command("compile")
@click.argument("source")
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path), help="Artifact directory.")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="tensorsmith.toml with settings.")
@click.option("--checkpoint", type=click.Path(path_type=Path), help=".safetensors or .pt/.pth (weights only).")
@click.option("--input", "inputs", multiple=True, metavar="NAME:DTYPE:DIMS", help="e.g. input_ids:int64:batch,128")
@click.option("--output-name", "outputs", multiple=True, help="Names for the model's outputs, in order.")
@click.option("--opset", type=int, help="ai.onnx opset of the compiled graph (default 20).")
@click.option("--exporter", type=click.Choice(["auto", "dynamo", "torchscript"]), help="PyTorch exporter.")
@click.option("--target", "targets", multiple=True, metavar="TARGET", help="Architecture to compile for (cpu).")
@click.option(
    "--precision",
    type=click.Choice(["fp32", "fp16", "int8", "fp8", "auto"]),
    help="int8/fp8: quantize every layer the policy allows; auto: choose per layer and target within --budget.",
)
@click.option("--budget", help="For --precision auto, e.g. 'cosine>=0.995' (cosine, min-cosine, max-abs, sqnr-db).")
@click.option("--calibrator", type=click.Choice(["entropy", "percentile", "minmax"]), help="Default: entropy.")
@click.option("--percentile", type=float, help="For --calibrator percentile (default 99.99).")
@click.option("--calibration", type=click.Path(path_type=Path), help=".npz of inputs (samples on axis 0), or a folder.")
@click.option("--calibration-samples", type=int, help="Use at most N calibration samples.")
@click.option("--eval-data", "evaluation", type=click.Path(path_type=Path), help="Held-out .npz for accuracy.")
@click.option("--engine-cache", type=click.Path(path_type=Path), help="Reuse engines built before (a directory).")
@click.option("--no-fuse", is_flag=True, help="Skip the fusion passes (LayerNorm, GELU, attention scale).")
@click.option("--no-verify", is_flag=True, help="Skip comparing the compiled graph with the source.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def compile_command(
    source: str,
    out: Path,
    config_path: Path | None,
    checkpoint: Path | None,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    opset: int | None,
    exporter: str | None,
    targets: tuple[str, ...],
    precision: str | None,
    budget: str | None,
    calibrator: str | None,
    percentile: float | None,
    calibration: Path | None,
    calibration_samples: int | None,
    evaluation: Path | None,
    engine_cache: Path | None,
    no_fuse: bool,
    no_verify: bool,
    as_json: bool,
) -> None:
    """Compile SOURCE (a tensorsmith.toml, model.onnx, model.pt2, or pkg.module:function) into OUT."""
    from tensorsmith.compiler import CompileConfig, compile
    from tensorsmith.compiler.config import parse_input_flag

    overrides: dict[str, Any] = {
        "checkpoint": str(checkpoint.resolve()) if checkpoint else None,
        "inputs": [parse_input_flag(text) for text in inputs] or None,
        "outputs": list(outputs) or None,
        "opset": opset,
        "exporter": exporter,
        "targets": list(targets) or None,
        "precision": precision,
        "budget": budget,
        "calibrator": calibrator,
        "percentile": percentile,
        "calibration": str(calibration.resolve()) if calibration else None,
        "calibration_samples": calibration_samples,
        "evaluation": str(evaluation.resolve()) if evaluation else None,
        "fuse": False if no_fuse else None,
        "verify": False if no_verify else None,
    }
    if engine_cache is not None:
        overrides["build"] = {"engine_cache_dir": str(engine_cache.resolve())}
    if source.endswith(".toml"):
        config = CompileConfig.from_toml(source, **overrides)
    else:
        if source.endswith((".onnx", ".pt2")):
            source = str(Path(source).resolve())
        if config_path is not None:
            config = CompileConfig.from_toml(config_path, source=source, **overrides)
        else:
            fields = {key: value for key, value in overrides.items() if value is not None}
            config = CompileConfig.create({"source": source, **fields})

    with _reporter() as reporter:
        result = compile(config, out, reporter=reporter)

    manifest = result.manifest
    failed = _failed(manifest)
    if as_json:
        payload = manifest.model_dump(mode="json")
        emit_json({"ok": result.budget_met and not failed, "out": str(result.out), "seconds": result.seconds,
                   "unmet_budgets": result.unmet_budgets, **payload})  # fmt: skip
        _exit_if_unmet(result.unmet_budgets, result.out, failed)
        return
    stdout.print(f"[bold green]compiled[/] {config.source} → {result.out} in {result.seconds:.1f} s")
    stdout.print(f"  exporter: {manifest.source.exporter}, opset {manifest.source.opset} → {config.opset}")
    for record in manifest.passes:
        stdout.print(f"  pass {record.name}: {record.counts} ({record.seconds:.2f} s)")
    for variant in manifest.variants:
        accuracy = ", ".join(f"{k}={v:.4g}" for k, v in variant.accuracy.items()) or "not verified"
        stdout.print(f"  variant {variant.name}: {variant.path} ({accuracy})")
    for target in manifest.targets:
        engine = f" → {target.engine.path}" if target.engine else ""
        engine += " (engine cache hit)" if target.engine and target.engine.cache == "hit" else ""
        stdout.print(f"  target {target.name}: {target.status} via {target.builder}{engine} {target.reason}".rstrip())
    _exit_if_unmet(result.unmet_budgets, result.out, failed)


def _failed(manifest: Any) -> list[str]:
    return [f"{t.name}: {t.reason}" for t in manifest.targets if t.status == "failed"]


def _exit_if_unmet(unmet: list[str], out: Path, failed: list[str] | None = None) -> None:
    """Exit code 3: the accuracy budget does not hold; 1: an engine failed to build. The artifact (the best
    plan, the other engines) is written all the same."""
    if unmet:
        click.echo(
            f"error: accuracy budget not met: {'; '.join(unmet)} (hint: the best plan is in {out}/precision.json; "
            "loosen --budget, add calibration data, or pin layers with [[overrides]])",
            err=True,
        )
        sys.exit(3)
    if failed:
        click.echo(f"error: engine builds failed: {'; '.join(failed)} (hint: see {out}/manifest.json)", err=True)
        sys.exit(1)


@main.command("build")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--target", required=True, help="Architecture, e.g. sm_90.")
@click.option("--builder", type=click.Choice(["tensorrt", "tensorrt-rtx"]), help="Default: whichever covers it.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def build_command(artifact: Path, target: str, builder: str | None, as_json: bool) -> None:
    """Add TARGET's engine to an existing artifact (e.g. on a GPU runner in CI)."""
    from tensorsmith.compiler.engines import build_target

    with _reporter() as reporter:
        record = build_target(artifact, target, builder, reporter=reporter)
    if as_json:
        emit_json({"ok": True, "artifact": str(artifact), **record.model_dump(mode="json")})
        return
    assert record.engine is not None
    stdout.print(f"built {target} with {record.builder} {record.engine.builder_version} → {record.engine.path}")


@main.command("run")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--inputs", "inputs_path", required=True, type=click.Path(path_type=Path), help="Feeds (.npz).")
@click.option("--output", "output_path", type=click.Path(path_type=Path), help="Write the outputs here (.npz).")
@click.option("--backend", type=click.Choice(["auto", "tensorrt", "onnxruntime"]), default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def run_command(artifact: Path, inputs_path: Path, output_path: Path | None, backend: str, as_json: bool) -> None:
    """Run the artifact ARTIFACT on the arrays in an .npz file."""
    from tensorsmith.runtime import load

    try:
        with np.load(inputs_path, allow_pickle=False) as archive:
            feeds = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as err:
        raise TensorsmithError(f"cannot read feeds from {inputs_path}: {err}", hint="pass an .npz of arrays") from err
    with load(artifact, backend=backend) as model:
        outputs = model.run(feeds)
        backend_name, reason = model.backend, model.fallback_reason
    if output_path is not None:
        np.savez(output_path, **outputs)
    summary = {name: {"shape": list(array.shape), "dtype": array.dtype.name} for name, array in outputs.items()}
    if as_json:
        emit_json({"ok": True, "backend": backend_name, "fallback_reason": reason, "outputs": summary})
        return
    stdout.print(f"backend: {backend_name}" + (f" (fallback: {reason})" if reason else ""))
    for name, info in summary.items():
        stdout.print(f"  {name}: {info['dtype']} {tuple(info['shape'])}")
    if output_path is not None:
        stdout.print(f"wrote {output_path}")


def _specs_table(title: str, records: list[dict[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("name", "dtype", "shape"):
        table.add_column(column)
    for record in records:
        table.add_row(record["name"], record["dtype"], str(record["shape"]))
    return table


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def inspect_command(path: Path, as_json: bool) -> None:
    """Summarize an artifact directory OUT or an ONNX file."""
    from tensorsmith.compiler.inspection import inspect_path

    summary = inspect_path(path)
    if as_json:
        emit_json({"ok": True, **summary})
        return
    if summary["kind"] == "onnx":
        stdout.print(
            f"[bold]{path}[/]: opset {summary['opset']}, {summary['nodes']} nodes, "
            f"{summary['parameters']:,} parameters, {summary['bytes'] / 1e6:.1f} MB ({summary['producer']})"
        )
        stdout.print(_specs_table("inputs", summary["inputs"]))
        stdout.print(_specs_table("outputs", summary["outputs"]))
        stdout.print("ops: " + ", ".join(f"{op}×{count}" for op, count in summary["ops"].items()))
        return
    source = summary["source"]
    stdout.print(f"[bold]{path}[/]: tensorsmith {summary['tensorsmith_version']} artifact")
    stdout.print(
        f"  source: {source['kind']} {source['path']} (exporter {source['exporter']}, opset {source['opset']})"
    )
    stdout.print(_specs_table("inputs", summary["inputs"]))
    stdout.print(_specs_table("outputs", summary["outputs"]))
    for record in summary["passes"]:
        stdout.print(f"  pass {record['name']}: changed={record['changed']} {record['counts']}")
    for variant in summary["variants"]:
        stdout.print(f"  variant {variant['name']}: {variant['path']} {variant['precisions']} {variant['accuracy']}")
    for target in summary["targets"]:
        stdout.print(f"  target {target['name']}: {target['status']} via {target['builder']} ({target['reason']})")


@main.command("export-triton")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--target", required=True, help="cpu (the cpu variant on ONNX Runtime) or sm_XX (its engine).")
@click.option("-o", "--repository", required=True, type=click.Path(path_type=Path), help="Triton model repository.")
@click.option("--name", help="Model name in the repository (default: the artifact's directory name).")
@click.option("--max-batch", type=int, help="max_batch_size (default: the engine profile's largest batch).")
@click.option("--max-queue-delay-us", type=int, default=15000, show_default=True, help="Dynamic batcher delay.")
@click.option("--instances", type=int, default=1, show_default=True, help="instance_group count.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def export_triton_command(
    artifact: Path,
    target: str,
    repository: Path,
    name: str | None,
    max_batch: int | None,
    max_queue_delay_us: int,
    instances: int,
    as_json: bool,
) -> None:
    """Write ARTIFACT's TARGET as a Triton model: REPO/NAME/config.pbtxt and REPO/NAME/1/model.plan|onnx."""
    from tensorsmith.compiler.triton import export_triton

    model = export_triton(artifact, target, repository, name, max_batch, max_queue_delay_us, instances)
    if as_json:
        emit_json({"ok": True, "model": str(model.directory), "platform": model.platform,
                   "model_file": model.model_file, "max_batch_size": model.max_batch_size,
                   "preferred_batch_size": model.preferred_batch_sizes, "warnings": model.warnings})  # fmt: skip
        return
    stdout.print(f"wrote {model.directory} ({model.platform}, 1/{model.model_file}, max_batch_size "
                 f"{model.max_batch_size}, preferred {model.preferred_batch_sizes})")  # fmt: skip
    # model.warnings went to the log (stderr) already


@main.command("report")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def report_command(artifact: Path, as_json: bool) -> None:
    """Regenerate ARTIFACT/report.json and report.html from the artifact's files."""
    from tensorsmith.compiler.report import REPORT_HTML, REPORT_JSON, write_report
    from tensorsmith.runtime.manifest import read_manifest

    read_manifest(artifact)  # a clear error for a path that is not an artifact
    report = write_report(artifact)
    paths = {"json": str(artifact / REPORT_JSON), "html": str(artifact / REPORT_HTML)}
    if as_json:
        emit_json({"ok": True, "report": paths, "sections": sorted(report)})
        return
    stdout.print(f"wrote {paths['html']} and {paths['json']}")


if __name__ == "__main__":
    main()
