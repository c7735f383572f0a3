"""Write an artifact directory atomically: everything goes to a temporary sibling that is renamed into place.

A compile that fails or is killed leaves the previous OUT as it was; readers never see a half-written one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tensorsmith.compiler.errors import ConfigError
from tensorsmith.runtime.manifest import MANIFEST_NAME, Manifest

logger = logging.getLogger(__name__)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _check_replaceable(out: Path, marker: str) -> None:
    """Refuse to replace a directory without `marker`, the file tensorsmith writes in it (an `-o ~` typo must
    not erase $HOME)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} exists and is not a directory", hint="choose another -o path")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise ConfigError(
            f"output {out} is a non-empty directory without {marker}: not written by tensorsmith",
            hint="choose a new or empty -o directory; tensorsmith only replaces what it wrote",
        )


def _publish(staging: Path, out: Path) -> None:
    if not out.exists():
        os.replace(staging, out)
        return
    # Two renames: the old artifact stays whole under `.NAME.old-*` until the new one is in place.
    retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, retired / out.name)
    os.replace(staging, out)
    shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def staged_artifact(out: Path, marker: str = MANIFEST_NAME) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces `out`, on error it is removed. An
    existing `out` is replaced only if it holds `marker`."""
    _check_replaceable(out, marker)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the published artifact gets normal permissions
    try:
        yield staging
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("wrote %s", out)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write manifest.json through a temporary file and a rename: readers see the old one or the new one."""
    text = json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n"
    replace_file(directory / MANIFEST_NAME, text.encode())


def replace_file(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.chmod(stream.name, 0o666 & ~_umask())
    os.replace(stream.name, path)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on an artifact directory, for read-modify-write of its manifest by concurrent builds."""
    import fcntl

    with (directory / ".tensorsmith.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
