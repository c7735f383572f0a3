"""The `tensorsmith` command. Each command parses flags, calls one library function, and prints."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import click
import numpy as np
from rich.table import Table

from tensorsmith.cli.calibrate import calibrate_command
from tensorsmith.cli.compile import compile_command
from tensorsmith.cli.engines import build_command, merge_command
from tensorsmith.cli.generate import generate_command
from tensorsmith.cli.output import backend_option, emit_json, handle_errors, setup_logging, stdout
from tensorsmith.cli.serve import serve_command
from tensorsmith.runtime.errors import TensorsmithError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug); tracebacks on errors.")
@click.version_option(package_name="tensorsmith")
def main(verbose: int) -> None:
    """tensorsmith: compile PyTorch and ONNX models into per-architecture TensorRT engines."""
    setup_logging(verbose)


main.add_command(compile_command)
main.add_command(build_command)
main.add_command(merge_command)
main.add_command(calibrate_command)
main.add_command(generate_command)
main.add_command(serve_command)


@main.command("run")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--inputs", "inputs_path", required=True, type=click.Path(path_type=Path), help="Feeds (.npz).")
@click.option("--output", "output_path", type=click.Path(path_type=Path), help="Write the outputs here (.npz).")
@backend_option
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
        np.savez(output_path, allow_pickle=True, **outputs)  # numpy's default, named: `**outputs` fills the arrays only
    summary = {name: {"shape": list(array.shape), "dtype": array.dtype.name} for name, array in outputs.items()}
    if as_json:
        emit_json({"ok": True, "backend": backend_name, "fallback_reason": reason, "outputs": summary})
        return
    stdout.print(f"backend: {backend_name}" + (f" (fallback: {reason})" if reason else ""))
    for name, info in summary.items():
        stdout.print(f"  {name}: {info['dtype']} {tuple(info['shape'])}")
    if output_path is not None:
        stdout.print(f"wrote {output_path}")


def _specs_table(title: str, records: Sequence[Mapping[str, object]]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("name", "dtype", "shape"):
        table.add_column(column)
    for record in records:
        table.add_row(str(record["name"]), str(record["dtype"]), str(record["shape"]))
    return table


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def inspect_command(path: Path, as_json: bool) -> None:
    """Summarize an artifact directory OUT or an ONNX file."""
    from tensorsmith.compiler.artifact.inspection import inspect_path
    from tensorsmith.compiler.report.summary import artifact_lines
    from tensorsmith.compiler.variants.precision_plan import PrecisionPlan
    from tensorsmith.runtime.manifest import read_manifest

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
    manifest = read_manifest(path)
    stdout.print(f"[bold]{path}[/]: tensorsmith {manifest.tensorsmith_version} artifact of {manifest.source.path}")
    source, *lines = artifact_lines(manifest, PrecisionPlan.read(path))
    stdout.print(f"  {source}", markup=False)
    stdout.print(_specs_table("inputs", summary["inputs"]))
    stdout.print(_specs_table("outputs", summary["outputs"]))
    for line in lines:
        stdout.print(f"  {line}", markup=False)


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
    from tensorsmith.compiler.artifact.triton import export_triton

    model = export_triton(artifact, target, repository, name, max_batch, max_queue_delay_us, instances)
    if as_json:
        emit_json(
            {
                "ok": True,
                "model": str(model.directory),
                "platform": model.platform,
                "model_file": model.model_file,
                "max_batch_size": model.max_batch_size,
                "preferred_batch_size": model.preferred_batch_sizes,
                "warnings": model.warnings,
            }
        )
        return
    stdout.print(
        f"wrote {model.directory} ({model.platform}, 1/{model.model_file}, max_batch_size "
        f"{model.max_batch_size}, preferred {model.preferred_batch_sizes})"
    )
    # model.warnings went to the log (stderr) already


@main.command("report")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def report_command(artifact: Path, as_json: bool) -> None:
    """Regenerate ARTIFACT/report.json and report.html from the artifact's files."""
    from tensorsmith.compiler.report.collect import REPORT_HTML, REPORT_JSON, write_report
    from tensorsmith.runtime.manifest import read_manifest

    read_manifest(artifact)  # a clear error for a path that is not an artifact
    report = write_report(artifact)
    paths = {"json": str(artifact / REPORT_JSON), "html": str(artifact / REPORT_HTML)}
    if as_json:
        emit_json({"ok": True, "report": paths, "sections": sorted(report)})
        return
    stdout.print(f"wrote {paths['html']} and {paths['json']}")


def entry() -> None:
    """The `tensorsmith` console script: `main`, then the process ends without the interpreter's teardown of the
    libraries a command loaded (torch, transformers, ONNX Runtime: 0.8-1.3 s a command on this machine, after the
    work is done). Exit handlers still run, and the streams and logs are flushed first."""
    try:
        main()
        code = 0
    except SystemExit as done:  # click ends every command this way
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
