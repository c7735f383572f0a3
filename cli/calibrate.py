"""`tensorsmith calibrate`: one shard's calibration statistics (or all shards as Ray tasks), for `compile
--calibration-stats`."""

from __future__ import annotations

from pathlib import Path

import click

from tensorsmith.cli.compile import SOURCE_FLAGS, config_from_flags, config_option
from tensorsmith.cli.config_flags import options, overrides
from tensorsmith.cli.output import emit_json, handle_errors, progress_reporter, stdout, terminable


@click.command("calibrate")
@click.argument("source")
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path), help="Statistics file (.npz).")
@config_option
@options(SOURCE_FLAGS)  # as for compile: the statistics are of the graph it makes
@click.option("--shard", metavar="I/N", help="Only the I-th of N contiguous shards of the samples (0-based).")
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="local",
    metavar="[ADDRESS]",
    help="Run every shard as a Ray task (a local Ray without ADDRESS) and merge them.",
)
@click.option("--shards", type=int, help="With --ray: how many shards (default 4).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
@terminable
def calibrate_command(
    source: str,
    out: Path,
    config_path: Path | None,
    shard: str | None,
    ray_address: str | None,
    shards: int | None,
    as_json: bool,
    **flags: object,
) -> None:
    """Collect the calibration statistics of SOURCE's fused graph on (a shard of) --calibration into OUT; merge
    shards with `tensorsmith compile SOURCE --calibration-stats 'DIR/*.npz' --eval-data …`."""
    from tensorsmith.compiler.calibrate import calibrate, parse_shard
    from tensorsmith.core.errors import ConfigError

    config = config_from_flags(source, config_path, overrides(SOURCE_FLAGS, dict(flags)))
    if ray_address is not None and shard is not None:
        raise ConfigError("--ray runs every shard itself: drop --shard", hint="or drop --ray to collect one shard")
    if ray_address is not None and Path(ray_address).exists():
        raise ConfigError(
            f"--ray took '{ray_address}' as the Ray address", hint="put --ray after SOURCE, or write --ray=ADDRESS"
        )
    if ray_address is None and shards is not None:
        raise ConfigError("--shards is for --ray", hint="for one shard of N, pass --shard I/N")
    if shards is not None and shards < 1:
        raise ConfigError(f"--shards {shards}: at least 1", hint="e.g. --shards 4")
    with progress_reporter() as reporter:
        if ray_address is not None:
            from tensorsmith.compiler.calibrate import calibrate_on_ray

            address = None if ray_address == "local" else ray_address
            result = calibrate_on_ray(config, out, shards or 4, address, reporter=reporter)
        else:
            result = calibrate(config, out, parse_shard(shard) if shard else None, reporter=reporter)
    summary = {
        "ok": True,
        "out": str(result.out),
        "graph_sha256": result.graph_sha256,
        "samples": result.samples,
        "tensors": result.tensors,
        "shard": list(result.shard) if result.shard else None,
        "seconds": result.seconds,
    }
    if as_json:
        emit_json(summary)
        return
    which = f"shard {result.shard[0]}/{result.shard[1]}" if result.shard else "all samples"
    stdout.print(
        f"[bold green]calibrated[/] {config.source} ({which}: {result.samples} samples, {result.tensors} "
        f"tensors) → {result.out} in {result.seconds:.1f} s"
    )
