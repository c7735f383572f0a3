"""Write an artifact directory atomically: everything goes to a temporary sibling that is renamed into place.

A compile that fails or is killed leaves the previous OUT as it was; readers never see a half-written one:
- the new artifact is built in `.OUT.tmp-*` and swapped with OUT in one `renameat2(RENAME_EXCHANGE)` (Linux);
  elsewhere, two renames through `.OUT.old-*`, and a later run puts an orphaned old artifact back;
- one writer at a time: `.OUT.lock` beside OUT is held (flock) for the whole compile, so a second compile into
  the same OUT fails at once, naming the holder; `tensorsmith build` holds it shared, so builds run side by
  side but never while a compile replaces OUT;
- each temporary directory holds a flock on its own `.owner` file while its process lives; the next run removes
  the ones whose owner is gone (killed compiles), and never one still being written.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from tensorsmith.core.errors import ConfigError
from tensorsmith.core.files import current_umask, replace_file
from tensorsmith.runtime.manifest import MANIFEST_NAME, Manifest

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, a quota, a file size limit

logger = logging.getLogger(__name__)


def check_replaceable(out: Path, marker: str = MANIFEST_NAME) -> None:
    """Refuse to replace a directory without `marker`, the file tensorsmith writes in it (an `-o ~` typo must
    not erase $HOME)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} exists and is not a directory", hint="choose another -o path")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise ConfigError(
            f"output {out} is a non-empty directory without {marker}: not written by tensorsmith",
            hint="choose a new or empty -o directory; tensorsmith only replaces what it wrote",
        )


RENAME_EXCHANGE = 2  # linux/fs.h
OWNER_FILE = ".owner"


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where that is unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE)
    return bool(result == 0)


def _publish(staging: Path, out: Path) -> None:
    if not out.exists():
        os.replace(staging, out)
        return
    if _exchange(staging, out):  # OUT is the new artifact; staging holds the old one, removed by the caller
        return
    # Two renames: the old artifact stays whole under `.NAME.old-*` until the new one is in place (a kill in
    # between is mended by `_restore_orphan` on the next run).
    retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, retired / out.name)
    os.replace(staging, out)
    shutil.rmtree(retired, ignore_errors=True)


def _held_by_a_live_process(directory: Path) -> bool:
    """Whether the process that made `directory` still holds the flock on its owner file."""
    try:
        with (directory / OWNER_FILE).open("r") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no owner file: made by an older tensorsmith, or killed before it was written
        return False
    return False


def _restore_orphan(out: Path) -> None:
    """A kill between the two renames of the fallback publish leaves OUT missing and the old artifact in
    `.OUT.old-*/OUT`: put it back."""
    if out.exists():
        return
    for retired in sorted(out.parent.glob(f".{out.name}.old-*")):
        if (retired / out.name / MANIFEST_NAME).is_file():
            os.replace(retired / out.name, out)
            logger.warning("restored %s from %s (a compile was killed while publishing)", out, retired)
            return


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove the temporary siblings of `out` whose writer is gone; return them."""
    _restore_orphan(out)
    removed = []
    for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*"):
        for stale in out.parent.glob(pattern):
            if stale.is_dir() and not _held_by_a_live_process(stale):
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(stale)
    if removed:
        logger.info("removed %d temporary directories left by killed runs: %s", len(removed), removed)
    return removed


@contextlib.contextmanager
def artifact_lock(out: Path, shared: bool = False) -> Iterator[None]:
    """`.OUT.lock` beside OUT, held for a whole compile (exclusive: it replaces OUT) or a whole `tensorsmith
    build` (shared: builds add engines side by side). Whoever cannot have it fails at once, saying who holds it.
    The exclusive holder removes the file when done."""
    path = out.parent / f".{out.name}.lock"
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            # A compile unlinks the file when done: a lock won on an unlinked file is no lock at all.
            if os.fstat(handle.fileno()).st_ino != os.stat(path).st_ino:
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            handle.seek(0)
            holder = handle.read().strip()
            doing = f"replaced by a tensorsmith compile ({holder})" if holder else "changed by a tensorsmith build"
            raise ConfigError(
                f"{out} is being {doing}", hint="wait for it to finish, or write to another -o directory"
            ) from None
        if not shared:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()}")
            handle.flush()
        try:
            yield
        finally:
            if not shared:
                path.unlink(missing_ok=True)  # while still holding the lock (a killed run's file stays, unlocked)


def _own(staging: Path) -> IO[str]:
    """Mark `staging` as this process's while it lives (see `_held_by_a_live_process`)."""
    handle = (staging / OWNER_FILE).open("w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


@contextlib.contextmanager
def staged_artifact(out: Path, marker: str = MANIFEST_NAME) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces `out`, on error it is removed. An
    existing `out` is replaced only if it holds `marker`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with artifact_lock(out):
        remove_stale_staging(out)
        check_replaceable(out, marker)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        staging.chmod(0o777 & ~current_umask())  # mkdtemp makes it private; the published artifact gets normal ones
        owner = _own(staging)
        try:
            try:
                yield staging
            except OSError as err:
                if err.errno not in DISK_FULL:
                    raise
                try:
                    said = _disk_full(err, out, staging)
                except Exception:  # naming the file must never hide the error itself
                    raise err from None
                raise said from err
            owner.close()
            (staging / OWNER_FILE).unlink()
            _publish(staging, out)
        finally:
            owner.close()
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("wrote %s", out)


def _newest_file(directory: Path) -> Path:
    """The file written last under `directory` (the one a write without a file name failed on), or `directory`."""
    files = [path for path in directory.rglob("*") if path.is_file() and path.name != OWNER_FILE]
    return max(files, key=lambda path: path.stat().st_mtime_ns, default=directory)


def _disk_full(err: OSError, out: Path, staging: Path) -> ConfigError:
    """A write the disk (or a file size limit) refused, as one line naming the file: the staging directory is
    removed as the error passes, so nothing is left half-written."""
    named = err.filename2 or err.filename  # a copy's destination is the second name
    where = Path(os.fsdecode(named)) if named else _newest_file(staging)
    shown = out / where.relative_to(staging) if where.is_relative_to(staging) else where
    existing = where
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free / 1e9
    error = ConfigError(
        f"writing {shown} failed: {err.strerror or 'no space left'}; nothing was written to {out}",
        hint=f"{free:.1f} GB are free there now: free some, or write the artifact to another disk with -o",
    )
    return error


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write manifest.json through a temporary file and a rename: readers see the old one or the new one."""
    text = json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n"
    replace_file(directory / MANIFEST_NAME, text.encode())


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on an artifact directory, for read-modify-write of its manifest by concurrent builds."""
    with (directory / ".tensorsmith.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
