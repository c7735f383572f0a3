"""This process's resident memory: its peak per compile stage (the manifest's steps), and freed memory given back."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import threading
from pathlib import Path

COLLECT_ABOVE = 4 << 30  # a full collection takes 0.24 s with torch loaded (more in a test worker): large only


def release_freed_memory() -> None:
    """Return the C heap's free pages to the system (glibc keeps what a stage freed: at the 1B shape, 7 GB after
    the graph passes, which the next stage's peak would otherwise stand on), collecting cycles first in a large
    process (transformers' modules hold reference cycles)."""
    if (current_rss() or 0) > COLLECT_ABOVE:
        gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim), without a garbage collection."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # musl and other C libraries have no malloc_trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakSampler:
    """The highest resident set of this process while it runs, sampled every `interval` seconds on a daemon thread.
    Sampled, not the kernel's high-water mark: resetting that (/proc/self/clear_refs) would also reset the peak
    that wait4 and `time -v` report for the whole process."""

    def __init__(self, interval: float = 0.05) -> None:
        self._interval = interval
        self._stop = threading.Event()
        self.peak = current_rss() or 0
        self._thread = threading.Thread(target=self._sample, name="tensorsmith-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, current_rss() or 0)

    def stop(self) -> int | None:
        """The peak in bytes (None where /proc cannot say)."""
        self._stop.set()
        self._thread.join()
        last = current_rss()
        return max(self.peak, last) if last is not None else None


def current_rss() -> int | None:
    """This process's resident set now, in bytes (/proc/self/statm; None off Linux)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def available_memory(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process may still take: Linux's MemAvailable, or less where a cgroup v2 limit (a container's)
    leaves less; None elsewhere."""
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    left = cgroup_memory_left(cgroup)
    return available if left is None else min(available, left)


def cgroup_memory_left(cgroup: Path) -> int | None:
    """A cgroup v2's limit less what it holds, its page cache not counted (reclaimable); None without a limit."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
        return int(limit) - (int((cgroup / "memory.current").read_text()) - int(stat.get("file", 0)))
    except (OSError, ValueError):
        return None
