"""How long work reports itself: stages and counted tasks. The CLI shows them with rich; the library logs."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from tensorsmith.core.memory import PeakSampler, release_freed_memory

logger = logging.getLogger("tensorsmith.progress")  # the CLI shows it at INFO when stderr is not a terminal

Advance = Callable[[int], None]


class Reporter(Protocol):
    def stage(self, text: str) -> None:
        """A new step of the pipeline begins."""

    def task(self, description: str, total: int | None) -> contextlib.AbstractContextManager[Advance]:
        """A counted piece of work; the context yields `advance(n)`."""


class LogReporter:
    """The default outside the CLI: stages and task ends as log lines, nothing per step."""

    def stage(self, text: str) -> None:
        logger.info("%s", text)

    @contextlib.contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Advance]:
        done = 0

        def advance(steps: int = 1) -> None:
            nonlocal done
            done += steps

        yield advance
        logger.info("%s: %d%s done", description, done, f"/{total}" if total else "")


@dataclass(frozen=True)
class Step:
    name: str
    seconds: float
    peak_rss_bytes: int | None  # this process's highest resident set in the step, sampled (None off Linux)


class TimedReporter:
    """Passes everything to another reporter and times each stage (until the next one begins, or `finish`), with
    the stage's peak resident memory: where a compile's time and memory go, in the manifest's steps."""

    def __init__(self, inner: Reporter) -> None:
        self._inner = inner
        self.steps: list[Step] = []
        self._current: tuple[str, float, PeakSampler] | None = None

    def _close(self) -> None:
        if self._current is not None:
            text, started, sampler = self._current
            self.steps.append(Step(text, round(time.perf_counter() - started, 3), sampler.stop()))
            self._current = None

    def stage(self, text: str) -> None:
        self._close()
        release_freed_memory()  # what the last stage freed goes back, so that this stage's peak is its own
        self._current = (text, time.perf_counter(), PeakSampler())
        self._inner.stage(text)

    def task(self, description: str, total: int | None) -> contextlib.AbstractContextManager[Advance]:
        return self._inner.task(description, total)

    def finish(self) -> list[Step]:
        self._close()
        return self.steps
