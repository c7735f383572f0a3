"""Where a graph's weights go when it is saved over the weights file it was read from (core/mapped_graph.py):
the weights no pass touched stay at their offsets, new arrays go into bytes no weight reads any more where they
fit, and the rest is appended; or, where that would leave too much of the file unread, the file is written whole.

Saving over the file rewrote every weight: the passes after canonicalize (40 MB of scaled q weights at the 135M
shape) and the cpu generation graph (no weight changed) wrote 1.3 GB there, 12 GB at the 1B shape. On a machine
where each fresh page of the page cache costs system time, the bytes not written are the saving.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    placed: dict[int, int]  # key → offset: a new array written into bytes no weight reads any more
    appended: int  # bytes written at the end
    unread: int  # bytes of the file no weight reads afterwards

    @property
    def described(self) -> str:
        return (
            f"{len(self.placed)} written into unread bytes, {self.appended / 1e6:.1f} MB appended, "
            f"{self.unread / 1e6:.1f} MB unread"
        )


def plan_layout(
    size: int,
    used: list[tuple[int, int]],
    still_read: list[tuple[int, int]],
    new: list[tuple[int, int, bool]],
    unread_at_most: float,
) -> Layout | None:
    """The layout of a `size`-byte file whose [start, stop) ranges `used` stay, for the `new` weights (key, bytes,
    whether it may go into a gap: arrays whose bytes are known), first fit, never into a range `still_read` by a
    value to be written; None where over `unread_at_most` of the file would be left unread."""
    gaps = _gaps(sorted(used), size)
    free = list(gaps)  # shrunk as arrays are placed
    for taken in still_read:
        free = [part for hole in free for part in _minus(hole, taken)]
    placed: dict[int, int] = {}
    appended = 0
    for key, nbytes, placeable in new:
        hole = next((i for i, (start, stop) in enumerate(free) if stop - start >= nbytes), None) if placeable else None
        if hole is None:
            appended += nbytes
            continue
        start, stop = free[hole]
        placed[key], free[hole] = start, (start + nbytes, stop)
    filled = sum(nbytes for key, nbytes, _ in new if key in placed)
    unread = sum(stop - start for start, stop in gaps) - filled  # a range still read is unread afterwards too
    return Layout(placed, appended, unread) if unread <= unread_at_most * (size + appended) else None


def _gaps(used: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges of [0, size) outside the sorted `used` ranges."""
    gaps, at = [], 0
    for start, stop in used:
        if start > at:
            gaps.append((at, start))
        at = max(at, stop)
    return [*gaps, (at, size)] if size > at else gaps


def _minus(hole: tuple[int, int], taken: tuple[int, int]) -> list[tuple[int, int]]:
    parts = [(hole[0], min(hole[1], taken[0])), (max(hole[0], taken[1]), hole[1])]
    return [(start, stop) for start, stop in parts if stop > start]


def nearly_all_read(files: set[Path], read: int, unread_at_most: float) -> Path | None:
    """The one file a graph's stored weights are all read from, where they read all of it but `unread_at_most`
    (a fraction): a file a new graph may keep, or share, as it is. None for several files, or too much unread."""
    if len(files) != 1:
        return None
    (only,) = files
    return only if read >= only.stat().st_size * (1 - unread_at_most) else None
