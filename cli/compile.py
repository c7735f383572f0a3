"""`tensorsmith compile`: a source into an artifact."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from tensorsmith.cli.config_flags import Flag, options
from tensorsmith.cli.config_flags import overrides as config_overrides
from tensorsmith.cli.output import emit_json, handle_errors, progress_reporter, stdout, terminable
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.flags import parse_dim_flag, parse_input_flag
from tensorsmith.core.precisions import FP8, requestable
from tensorsmith.runtime.manifest import Manifest


def _absolute_glob(pattern: str) -> str:
    return str(Path(pattern).expanduser().absolute())


# The flags of a source's graph: every command that reads SOURCE takes them (the graph depends on each)
SOURCE_FLAGS = [
    Flag("checkpoint"),
    Flag("inputs", name="--input", metavar="NAME:DTYPE:DIMS", convert=parse_input_flag),
    Flag("opset"),
    Flag("targets", name="--target", metavar="TARGET"),
    Flag("precision", choices=requestable),
    Flag("calibration"),
    Flag("calibration_samples"),
]
COMPILE_FLAGS = [
    Flag("dims", name="--dim", metavar="NAME=MIN:OPT:MAX", convert=parse_dim_flag, collect=dict),
    Flag("outputs", name="--output-name"),
    Flag("exporter"),
    Flag("budget"),
    Flag("calibrator"),
    Flag("percentile"),
    Flag("int4_algorithm"),
    Flag("int4_block_size"),
    Flag("calibration_stats", metavar="GLOB", convert=_absolute_glob),
    Flag("evaluation", name="--eval-data"),
    Flag("generation.max_sequence_length"),
    Flag("generation.max_batch"),
    Flag("generation.kv_cache"),
    Flag("generation.kv_cache_precision", choices=lambda: [FP8.name]),
    Flag("build.engine_cache_dir", name="--engine-cache"),
    Flag("export_cache_dir", name="--export-cache"),
    Flag("trace_every_layer"),
    Flag("check_resources", name="--no-resource-check"),
    Flag("layerwise"),
    Flag("mla_cache"),
    Flag("fuse"),
    Flag("verify"),
]
config_option = click.option(
    "--config", "config_path", type=click.Path(path_type=Path), help="tensorsmith.toml with settings."
)


@click.command("compile")
@click.argument("source")
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path), help="Artifact directory.")
@config_option
@options([*SOURCE_FLAGS, *COMPILE_FLAGS])
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
@terminable
def compile_command(source: str, out: Path, config_path: Path | None, as_json: bool, **flags: object) -> None:
    """Compile SOURCE into the artifact directory OUT.

    SOURCE is a Hugging Face model directory (config.json and safetensors, as save_pretrained writes them; a
    *ForCausalLM becomes a decoder with prefill and decode engines), an ONNX file, a .pt2 ExportedProgram, a
    factory pkg.module:function returning an nn.Module (with --checkpoint and --input), or a tensorsmith.toml."""
    from tensorsmith.compiler import compile

    overrides = config_overrides([*SOURCE_FLAGS, *COMPILE_FLAGS], flags)
    config = config_from_flags(source, config_path, overrides)
    with progress_reporter() as reporter:
        result = compile(config, out, reporter=reporter)

    from tensorsmith.compiler.report.summary import artifact_lines, unquantized_variants
    from tensorsmith.compiler.variants.precision_plan import PrecisionPlan

    manifest, plan = result.manifest, PrecisionPlan.read(result.out)
    failed = _failed(manifest)
    if as_json:
        payload = manifest.model_dump(mode="json")
        emit_json(
            {
                "ok": result.budget_met and not failed,
                "out": str(result.out),
                "seconds": result.seconds,
                "unmet_budgets": result.unmet_budgets,
                "unquantized_variants": unquantized_variants(plan),
                **payload,
            }
        )
        _exit_if_unmet(result.unmet_budgets, result.out, failed)
        return
    stdout.print(f"[bold green]compiled[/] {config.source} → {result.out} in {result.seconds:.1f} s")
    for line in artifact_lines(manifest, plan):
        stdout.print(f"  {line}", markup=False)  # reasons and paths may hold brackets
    _exit_if_unmet(result.unmet_budgets, result.out, failed)


def config_from_flags(source: str, config_path: Path | None, overrides: dict[str, object]) -> CompileConfig:
    """The CompileConfig of SOURCE (a tensorsmith.toml, or a model with --config), flags over the file's keys."""
    if source.endswith(".toml"):
        return CompileConfig.from_toml(source, **overrides)
    if source.endswith((".onnx", ".pt2")) or Path(source).is_dir():
        source = str(Path(source).resolve())
    if config_path is not None:
        return CompileConfig.from_toml(config_path, source=source, **overrides)
    fields = {key: value for key, value in overrides.items() if value is not None}
    return CompileConfig.create({"source": source, **fields})


def _failed(manifest: Manifest) -> list[str]:
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
