"""`tensorsmith build` and `tensorsmith merge`: engines added to an artifact that exists (a GPU runner's job in CI),
and the jobs' engines joined into one artifact."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from tensorsmith.cli.output import emit_json, handle_errors, progress_reporter, stdout, terminable

if TYPE_CHECKING:
    from tensorsmith.compiler.targets import Builder


@click.command("build")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--target", required=True, help="Architecture, e.g. sm_90.")
@click.option("--builder", type=click.Choice(["tensorrt", "tensorrt-rtx"]), help="Default: whichever covers it.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
@terminable
def build_command(artifact: Path, target: str, builder: Builder | None, as_json: bool) -> None:
    """Add TARGET's engine to an existing artifact (e.g. on a GPU runner in CI)."""
    from tensorsmith.compiler.add_engine import build_target

    with progress_reporter() as reporter:
        record = build_target(artifact, target, builder, reporter=reporter)
    if as_json:
        emit_json({"ok": True, "artifact": str(artifact), **record.model_dump(mode="json")})
        return
    assert record.engine is not None
    stdout.print(f"built {target} with {record.builder} {record.engine.builder_version} → {record.engine.path}")


@click.command("merge")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("parts", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
@terminable
def merge_command(artifact: Path, parts: tuple[Path, ...], as_json: bool) -> None:
    """Merge into ARTIFACT the engines that `tensorsmith build PART --target X` added to copies of it (PARTS: one
    per CI matrix job; each job's manifest.json and engines/ are enough).

    A command of its own rather than a flag of `build`: it builds nothing and needs no TensorRT, and like
    `git merge` or `coverage combine` it reads best as the one step that joins the jobs' results.
    """
    from tensorsmith.compiler.merge import merge_parts

    result = merge_parts(artifact, list(parts))
    if as_json:
        emit_json(
            {
                "ok": True,
                "artifact": str(artifact),
                "added": [
                    {"target": m.target, "part": str(m.part), **m.record.model_dump(mode="json")} for m in result.added
                ],
                "unchanged": result.unchanged,
                "pending": result.pending,
            }
        )
        return
    for merged in result.added:
        assert merged.record.engine is not None
        stdout.print(
            f"merged {merged.target} ({merged.record.builder} {merged.record.engine.builder_version}) "
            f"from {merged.part} → {artifact / merged.record.engine.path}",
            markup=False,
        )
    if result.unchanged:
        stdout.print(f"already in {artifact}, the same engines: {', '.join(result.unchanged)}", markup=False)
    if result.pending:
        stdout.print(f"still without an engine: {', '.join(result.pending)}", markup=False)
