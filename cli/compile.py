"""`tensorsmith compile`: a source into an artifact."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from tensorsmith.cli.output import emit_json, handle_errors, progress_reporter, stdout, terminable
from tensorsmith.core.precisions import CAPABILITIES, FP8, requestable

PRECISIONS = requestable()  # --precision: the precision table's requestable names, and auto


def source_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """--config, --checkpoint and --input: what finds and declares SOURCE, for every command that reads one."""
    path = click.Path(path_type=Path)
    for option in reversed(
        [
            click.option("--config", "config_path", type=path, help="tensorsmith.toml with settings."),
            click.option("--checkpoint", type=path, help=".safetensors or .pt/.pth (weights only)."),
            click.option(
                "--input", "inputs", multiple=True, metavar="NAME:DTYPE:DIMS", help="e.g. input_ids:int64:batch,128"
            ),
        ]
    ):
        function = option(function)
    return function


def source_overrides(checkpoint: Path | None, inputs: tuple[str, ...]) -> dict[str, Any]:
    """The config keys of --checkpoint and --input."""
    from tensorsmith.compiler.flags import parse_input_flag

    return {
        "checkpoint": str(checkpoint.resolve()) if checkpoint else None,
        "inputs": [parse_input_flag(text) for text in inputs] or None,
    }


@click.command("compile")
@click.argument("source")
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path), help="Artifact directory.")
@source_options
@click.option("--dim", "dims", multiple=True, metavar="NAME=MIN:OPT:MAX", help="A dynamic dim's sizes, as [dims.NAME].")
@click.option("--output-name", "outputs", multiple=True, help="Names for the model's outputs, in order.")
@click.option("--opset", type=int, help="ai.onnx opset of the compiled graph (default 20).")
@click.option("--exporter", type=click.Choice(["auto", "dynamo", "torchscript"]), help="PyTorch exporter.")
@click.option(
    "--target",
    "targets",
    multiple=True,
    metavar="TARGET",
    help=f"cpu, or a GPU architecture sm_XX (sm_{CAPABILITIES[0]} to sm_{CAPABILITIES[-1]}); repeat for several "
    "(default: cpu).",
)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    help="int8/fp8: quantize every layer the policy allows; int4: weight-only (AWQ); auto: choose per layer and "
    "target within --budget.",
)
@click.option(
    "--budget",
    help="For --precision auto, e.g. 'cosine>=0.995' (cosine, min-cosine, max-abs, sqnr-db; for decoders also "
    "perplexity-ratio, next-token-agreement, perplexity).",
)
@click.option("--calibrator", type=click.Choice(["entropy", "percentile", "minmax"]), help="Default: entropy.")
@click.option("--percentile", type=float, help="For --calibrator percentile (default 99.99).")
@click.option("--int4-algorithm", type=click.Choice(["awq", "rtn", "checkpoint"]), help="For int4 (default: awq).")
@click.option("--int4-block-size", type=click.Choice(["32", "64", "128"]), help="For --precision int4 (default 128).")
@click.option(
    "--calibration",
    type=click.Path(path_type=Path),
    help=".npz of inputs (samples on axis 0), or a folder; for a decoder, a .txt or an .npz of input_ids.",
)
@click.option(
    "--calibration-samples", type=int, help="Use at most N calibration samples (a decoder's text: windows, 64)."
)
@click.option(
    "--calibration-stats",
    metavar="GLOB",
    help="Statistics files from `tensorsmith calibrate` (e.g. 'stats/*.npz'), merged in place of --calibration.",
)
@click.option(
    "--eval-data",
    "evaluation",
    type=click.Path(path_type=Path),
    help="Held-out .npz for accuracy (decoders: .txt too).",
)
@click.option("--max-sequence-length", type=int, help="A decoder's prompt + new tokens, at most ([generation]).")
@click.option("--max-batch", type=int, help="A decoder's requests per call, at most ([generation]).")
@click.option(
    "--kv-cache",
    type=click.Choice(["static", "dynamic"]),
    help="A decoder's cache: static (request-long, updated in place; default where it applies) or dynamic "
    "(Optimum's/GenAI's names).",
)
@click.option(
    "--kv-cache-precision",
    type=click.Choice([FP8.name]),
    help="The engines' static cache in fp8 (sm_89+; its perplexity measured). Default: the variant's dtype.",
)
@click.option("--engine-cache", type=click.Path(path_type=Path), help="Reuse engines built before (a directory).")
@click.option(
    "--export-cache",
    type=click.Path(path_type=Path),
    help="Reuse the fused graph of an earlier compile of the same checkpoint (a directory): skips the export.",
)
@click.option(
    "--trace-every-layer",
    is_flag=True,
    help="Trace each decoder layer in the export (default: two, the rest repeated from the second).",
)
@click.option(
    "--no-resource-check",
    is_flag=True,
    help="Compile even where the memory and disk estimated before any work exceed what this machine has.",
)
@click.option(
    "--layerwise",
    type=click.Choice(["auto", "always", "never"]),
    help="Run the graphs that measure and calibrate one layer at a time: auto where their weights exceed a third "
    "of the available memory.",
)
@click.option(
    "--mla-cache",
    type=click.Choice(["latent", "full"]),
    help="DeepSeek-V2/V3's attention: cache the compressed latent and rotary key (latent), or every head's keys "
    "and values (full).",
)
@click.option("--no-fuse", is_flag=True, help="Skip the fusion passes (LayerNorm, GELU, attention scale).")
@click.option("--no-verify", is_flag=True, help="Skip comparing the compiled graph with the source.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
@terminable
def compile_command(
    source: str,
    out: Path,
    config_path: Path | None,
    checkpoint: Path | None,
    inputs: tuple[str, ...],
    dims: tuple[str, ...],
    outputs: tuple[str, ...],
    opset: int | None,
    exporter: str | None,
    targets: tuple[str, ...],
    precision: str | None,
    budget: str | None,
    calibrator: str | None,
    percentile: float | None,
    int4_algorithm: str | None,
    int4_block_size: str | None,
    calibration: Path | None,
    calibration_samples: int | None,
    calibration_stats: str | None,
    evaluation: Path | None,
    max_sequence_length: int | None,
    max_batch: int | None,
    kv_cache: str | None,
    kv_cache_precision: str | None,
    engine_cache: Path | None,
    export_cache: Path | None,
    trace_every_layer: bool,
    no_resource_check: bool,
    layerwise: str | None,
    mla_cache: str | None,
    no_fuse: bool,
    no_verify: bool,
    as_json: bool,
) -> None:
    """Compile SOURCE into the artifact directory OUT.

    SOURCE is a Hugging Face model directory (config.json and safetensors, as save_pretrained writes them; a
    *ForCausalLM becomes a decoder with prefill and decode engines), an ONNX file, a .pt2 ExportedProgram, a
    factory pkg.module:function returning an nn.Module (with --checkpoint and --input), or a tensorsmith.toml."""
    from tensorsmith.compiler import compile
    from tensorsmith.compiler.flags import parse_dim_flag

    overrides: dict[str, Any] = {
        **source_overrides(checkpoint, inputs),
        "dims": dict(parse_dim_flag(text) for text in dims) or None,
        "outputs": list(outputs) or None,
        "opset": opset,
        "exporter": exporter,
        "targets": list(targets) or None,
        "precision": precision,
        "budget": budget,
        "calibrator": calibrator,
        "percentile": percentile,
        "int4_algorithm": int4_algorithm,
        "int4_block_size": int(int4_block_size) if int4_block_size else None,
        "calibration": str(calibration.resolve()) if calibration else None,
        "calibration_samples": calibration_samples,
        "calibration_stats": str(Path(calibration_stats).expanduser().absolute()) if calibration_stats else None,
        "evaluation": str(evaluation.resolve()) if evaluation else None,
        "fuse": False if no_fuse else None,
        "trace_every_layer": True if trace_every_layer else None,
        "check_resources": False if no_resource_check else None,
        "layerwise": layerwise,
        "mla_cache": mla_cache,
        "verify": False if no_verify else None,
        "export_cache_dir": str(export_cache.resolve()) if export_cache else None,
    }
    if engine_cache is not None:
        overrides["build"] = {"engine_cache_dir": str(engine_cache.resolve())}
    lengths = {
        "max_sequence_length": max_sequence_length,
        "max_batch": max_batch,
        "kv_cache": kv_cache,
        "kv_cache_precision": kv_cache_precision,
    }
    if any(value is not None for value in lengths.values()):
        overrides["generation"] = {key: value for key, value in lengths.items() if value is not None}
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


def config_from_flags(source: str, config_path: Path | None, overrides: dict[str, Any]) -> Any:
    """The CompileConfig of SOURCE (a tensorsmith.toml, or a model with --config), flags over the file's keys."""
    from tensorsmith.compiler import CompileConfig

    if source.endswith(".toml"):
        return CompileConfig.from_toml(source, **overrides)
    if source.endswith((".onnx", ".pt2")) or Path(source).is_dir():
        source = str(Path(source).resolve())
    if config_path is not None:
        return CompileConfig.from_toml(config_path, source=source, **overrides)
    fields = {key: value for key, value in overrides.items() if value is not None}
    return CompileConfig.create({"source": source, **fields})


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
