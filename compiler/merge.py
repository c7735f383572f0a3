"""`tensorsmith merge OUT PART...`: the engines that CI matrix jobs built, one job a target, merged into one
artifact.

Each PART is a copy of the artifact OUT holds (the one the compile job uploaded) in which a job ran
`tensorsmith build PART --target X` for one or more targets; only its manifest.json and engines/ are read, so a
job may upload just those. For every target a part has built that OUT has not, the engine (`engines/X.engine`
and its `X.json`) is copied into OUT and the part's target record replaces OUT's (`pending`, or absent for a
target the compile did not have). Timing caches live outside the artifact (`[build] timing_cache_dir`), so
there is none to copy. A target OUT already has built with the same engine sha256 (an engine the compile built
before the artifact was copied, carried by every part) is left as it is.

Everything is checked before anything is written; a part is refused, naming it and the field, when it
- is from another compile: its source record, compiled graph or variants differ from OUT's (its engines were
  built from other bytes);
- holds a target's engine that differs from another part's or from the one OUT already has;
- adds no target (its job's `tensorsmith build` did not run, or it was merged before);
- names an engine that is missing or does not match its sha256.
Then the engines are copied in (each to a temporary file renamed into place) and the manifest is rewritten once,
atomically, under the locks `tensorsmith build` takes: a reader sees the old artifact or the merged one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tensorsmith.compiler.artifact.staging import artifact_lock, locked, write_manifest
from tensorsmith.compiler.report.collect import write_report
from tensorsmith.core.errors import ArtifactError
from tensorsmith.core.files import current_umask
from tensorsmith.runtime.manifest import Manifest, TargetRecord, read_manifest, resolve_inside, verified_file

logger = logging.getLogger(__name__)

SAME_COMPILE_HINT = (
    "merge only parts built from OUT's own artifact: each matrix job downloads what the compile job uploaded and "
    "runs `tensorsmith build` in it, it does not compile again"
)


@dataclass(frozen=True)
class MergedTarget:
    """A target's engine taken from `part` into OUT."""

    target: str
    part: Path
    record: TargetRecord


@dataclass(frozen=True)
class MergeResult:
    out: Path
    added: list[MergedTarget]
    unchanged: list[str]  # targets the parts carry with the engine OUT already has
    pending: list[str]  # OUT's targets still without an engine after the merge


def merge_parts(out: Path, parts: Sequence[Path]) -> MergeResult:
    """Merge the engines `parts` built into the artifact `out` (see the module's docstring)."""
    manifest = read_manifest(out)
    _check_distinct(out, parts)
    theirs = [(part, _read_part(part)) for part in parts]
    added, unchanged = _plan(manifest, theirs)  # every refusal before any lock is taken or file written
    with artifact_lock(out, shared=True), locked(out):  # no compile replaces OUT, no build rewrites its manifest
        current = read_manifest(out)
        if current != manifest:  # a build added an engine meanwhile: decide again, against what is there now
            manifest = current
            added, unchanged = _plan(manifest, theirs)
        for merged in added:
            _copy_engine(merged.part, out, merged.record)
        targets = {record.name: record for record in manifest.targets}
        targets.update({merged.target: merged.record for merged in added})  # in place, new ones last
        manifest.targets = list(targets.values())
        write_manifest(out, manifest)
        write_report(out)  # the engine table changed
    for merged in added:
        logger.info("merged the %s engine from %s", merged.target, merged.part)
    pending = [record.name for record in manifest.targets if record.status in ("pending", "failed")]
    return MergeResult(out=out, added=added, unchanged=unchanged, pending=pending)


def _check_distinct(out: Path, parts: Sequence[Path]) -> None:
    seen: dict[Path, Path] = {out.resolve(): out}
    for part in parts:
        resolved = part.resolve()
        if resolved in seen:
            what = "OUT itself" if seen[resolved] == out else f"given twice (as {seen[resolved]})"
            raise ArtifactError(f"part {part} is {what}", hint="pass each matrix job's copy once, and OUT apart")
        seen[resolved] = part


def _read_part(part: Path) -> Manifest:
    try:
        return read_manifest(part)
    except ArtifactError as err:
        raise ArtifactError(f"part {part}: {err.message}", hint=err.hint) from err


def _plan(manifest: Manifest, parts: list[tuple[Path, Manifest]]) -> tuple[list[MergedTarget], list[str]]:
    """What each part adds to `manifest`, every refusal raised before anything is written."""
    ours = {record.name: record for record in manifest.targets}
    claims: dict[str, MergedTarget] = {}
    unchanged: list[str] = []
    for part, theirs in parts:
        _check_same_compile(part, manifest, theirs)
        built = [record for record in theirs.targets if record.status == "built" and record.engine is not None]
        adds = []
        for record in built:
            assert record.engine is not None
            name, sha256 = record.name, record.engine.sha256
            current = ours.get(name)
            if current is not None and current.engine is not None and current.status == "built":
                if current.engine.sha256 != sha256:
                    raise ArtifactError(
                        f"part {part}: targets.{name}.engine.sha256 is {_short(sha256)}, but OUT already has another "
                        f"{name} engine ({_short(current.engine.sha256)})",
                        hint=f"OUT keeps the engine it has; build {name} in one job only, into a copy of the "
                        "compiled artifact where it is pending",
                    )
                if name not in unchanged:
                    unchanged.append(name)
                continue
            if current is not None and current.variant != record.variant:
                raise ArtifactError(
                    f"part {part}: targets.{name}.variant is {record.variant}, OUT's is {current.variant}",
                    hint=SAME_COMPILE_HINT,
                )
            claimed = claims.get(name)
            if claimed is not None:
                assert claimed.record.engine is not None
                if claimed.record.engine.sha256 != sha256:
                    raise ArtifactError(
                        f"part {part}: targets.{name}.engine.sha256 is {_short(sha256)}, but part {claimed.part} "
                        f"has another {name} engine ({_short(claimed.record.engine.sha256)})",
                        hint=f"build each target in one matrix job only; leave out one of the two {name} parts",
                    )
            else:
                _check_engine_file(part, record)
                claims[name] = MergedTarget(target=name, part=part, record=record)
            adds.append(name)
        if not adds:
            carried = (
                f"OUT already has its engines ({', '.join(r.name for r in built)})"
                if built
                else ("it has no built engine")
            )
            raise ArtifactError(
                f"part {part} adds no target: {carried}",
                hint="run `tensorsmith build PART --target X` in its job before uploading it, or leave out a part "
                "merged before",
            )
    return list(claims.values()), unchanged


def _check_same_compile(part: Path, manifest: Manifest, theirs: Manifest) -> None:
    """Refuse a part whose engines were built from other bytes than OUT's variants: the first field that differs."""
    expected, found = _compile_fields(manifest), _compile_fields(theirs)
    for field in [*expected, *(name for name in found if name not in expected)]:
        if expected.get(field) != found.get(field):
            raise ArtifactError(
                f"part {part} is from another compile: its {field} is {_shown(found.get(field))}, OUT's is "
                f"{_shown(expected.get(field))}",
                hint=SAME_COMPILE_HINT,
            )


def _compile_fields(manifest: Manifest) -> dict[str, object]:
    """The records that identify a compile: its source, the compiled graph, and each variant's bytes."""
    fields: dict[str, object] = {f"source.{key}": value for key, value in manifest.source.model_dump().items()}
    fields["model.sha256"] = manifest.model.sha256 if manifest.model else None
    for variant in manifest.variants:
        fields[f"variants.{variant.name}.sha256"] = variant.sha256
    return fields


def _short(sha256: str) -> str:
    return f"{sha256[:12]}…"


def _shown(value: object) -> str:
    if value is None:
        return "absent"
    text = str(value)
    if len(text) == 64 and all(char in "0123456789abcdef" for char in text):
        return _short(text)
    return text  # a path in full: cut, two paths of one tree would read the same


def _engine_files(record: TargetRecord) -> list[str]:
    """The files of a built target: its engine and, beside it, the build's details (NAME.json) if there are."""
    assert record.engine is not None
    return [record.engine.path, str(Path(record.engine.path).with_suffix(".json"))]


def _check_engine_file(part: Path, record: TargetRecord) -> None:
    assert record.engine is not None
    try:
        verified_file(part, record.engine.path, record.engine.sha256)
    except ArtifactError as err:
        raise ArtifactError(f"part {part}: target {record.name}: {err.message}", hint=err.hint) from err


def _copy_engine(part: Path, out: Path, record: TargetRecord) -> None:
    for relative in _engine_files(record):
        source = resolve_inside(part, relative)
        if source.is_file():
            _copy_file(source, resolve_inside(out, relative))


def _copy_file(source: Path, destination: Path) -> None:
    """Copy through a temporary file beside `destination`, fsynced, then renamed over it: never a part of one
    (engines are streamed, not read whole: they can be as large as the weights)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=destination.parent, prefix=f".{destination.name}.", delete=False) as stream:
        try:
            with source.open("rb") as reading:
                shutil.copyfileobj(reading, stream, 1 << 20)
            stream.flush()
            os.fsync(stream.fileno())
        except BaseException:
            os.unlink(stream.name)
            raise
    os.chmod(stream.name, 0o666 & ~current_umask())
    os.replace(stream.name, destination)
