"""How commands talk: one JSON object on stdout with --json, rich text otherwise; errors as one line + hint."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import click
from rich.console import Console, RenderableType

from tensorsmith.core.errors import UsageError
from tensorsmith.core.library_logs import LIBRARY_LOGGERS
from tensorsmith.core.progress import LogReporter
from tensorsmith.core.progress import logger as progress_logger
from tensorsmith.runtime.backends import AUTO, backend_names
from tensorsmith.runtime.errors import TensorsmithError

Params = ParamSpec("Params")
Result = TypeVar("Result")
USAGE = 2  # exit status of a usage error (click's own, and the shell convention)
INTERRUPTED = 130  # 128 + SIGINT
TERMINATED = 143  # 128 + SIGTERM

# `run`, `generate` and `serve` load an artifact on one row of runtime/backends.py, or on the best one here
backend_option = click.option(
    "--backend",
    type=click.Choice([AUTO, *backend_names()]),
    default=AUTO,
    show_default=True,
    help="What runs it: auto, the engine for this GPU, else the cpu variant on the backend the compile chose.",
)

# soft_wrap: long lines stay whole when piped to a file or a CI log.
stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    if stderr.is_terminal:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=stderr, show_path=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    if not stderr.is_terminal:  # no progress bars in a CI log: stages and task ends as plain lines instead
        logging.getLogger("tensorsmith.progress").setLevel(min(level, logging.INFO))
    # The exporters and Polygraphy are chatty at INFO; keep them to warnings unless -vv.
    for name in ("torch", "onnxscript", "polygraphy", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.ERROR if verbose < 2 else logging.DEBUG)
    # onnx-graphsurgeon and Polygraphy would print on stdout (core/library_logs.py): their lines only with -v.
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(level if verbose else logging.CRITICAL)
    # Python warnings from the libraries (torch, onnx, numpy) reach the terminal only with -v.
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").setLevel(logging.WARNING if verbose else logging.ERROR)


class RichReporter:
    """Stages as a spinner line, counted tasks as progress bars, on one rich Progress (stderr). A line without a
    total (the stage's) shows no bar and no count: `0/?` told nothing."""

    def __init__(self, console: Console) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            SpinnerColumn,
            Task,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class Counted(ProgressColumn):  # blank on a line without a total
            def __init__(self, column: ProgressColumn) -> None:
                super().__init__()
                self.column = column

            def render(self, task: Task) -> RenderableType:
                return self.column.render(task) if task.total is not None else Text("")

        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            Counted(BarColumn()),
            Counted(MofNCompleteColumn()),
            TimeElapsedColumn(),
            Counted(TimeRemainingColumn()),  # the ETA of a counted task
            console=console,
            transient=True,
        )
        self._stage = self._progress.add_task("compiling", total=None)

    def __enter__(self) -> RichReporter:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def stage(self, text: str) -> None:
        self._progress.update(self._stage, description=text)

    @contextlib.contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
        task = self._progress.add_task(description, total=total)

        def advance(steps: int = 1) -> None:
            self._progress.advance(task, steps)

        try:
            yield advance
        finally:
            self._progress.remove_task(task)


class PlainReporter(LogReporter):
    """Off a terminal (a CI log): LogReporter's lines, and while one stage runs on, a line after 5 s, 15 s, 35 s…
    (the waits double, up to a minute): an export or an engine build is not a long silence."""

    FIRST_BEAT = 5.0
    LONGEST_BEAT = 60.0

    def __init__(self, first_beat: float = FIRST_BEAT) -> None:
        self._first_beat = first_beat
        self._current: tuple[str, float] | None = None
        self._tasks: list[_Counted] = []  # the counted tasks running, innermost last: the beat says how far
        self._closed = False
        self._changed = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="tensorsmith-progress", daemon=True)

    def __enter__(self) -> PlainReporter:
        self._beats.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._changed.set()
        self._beats.join()

    def stage(self, text: str) -> None:
        super().stage(text)
        self._current = (text, time.perf_counter())
        self._changed.set()

    @contextlib.contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
        counted = _Counted(description, total, time.perf_counter())
        self._tasks.append(counted)

        def advance(steps: int = 1) -> None:
            counted.done += steps

        try:
            yield advance
        finally:
            self._tasks.remove(counted)
            progress_logger.info("%s: %d%s done", description, counted.done, f"/{total}" if total else "")

    def _beat(self) -> None:
        while True:
            self._changed.wait()  # a stage began, or the compile ended
            self._changed.clear()
            if self._closed or self._current is None:
                return
            text, started = self._current
            wait = self._first_beat
            while not self._changed.wait(wait):  # the stage still runs
                how_far = self._tasks[-1].how_far() if self._tasks else ""
                progress_logger.info("%s: still running (%.0f s%s)", text, time.perf_counter() - started, how_far)
                wait = min(wait * 2, self.LONGEST_BEAT)


@dataclass
class _Counted:
    """A counted task under way: how many of its steps are done, and since when."""

    description: str
    total: int | None
    started: float
    done: int = 0

    def how_far(self) -> str:
        """'; DESCRIPTION 32/129, about 12 min left' (the rate so far), or what is known of it."""
        text = f"; {self.description} {self.done}" + (f"/{self.total}" if self.total else "")
        if self.total and 0 < self.done < self.total:
            left = (time.perf_counter() - self.started) / self.done * (self.total - self.done)
            text += f", about {left / 60:.0f} min left" if left >= 90 else f", about {left:.0f} s left"
        return text


def emit_json(payload: Mapping[str, object]) -> None:
    click.echo(json.dumps(payload, indent=2, default=str))


def handle_errors(command: Callable[Params, Result]) -> Callable[Params, Result]:
    """Turn a TensorsmithError (or a ValueError from input checks) into one line + hint on stderr and exit 1."""

    @functools.wraps(command)
    def wrapper(*args: Params.args, **kwargs: Params.kwargs) -> Result:
        context = click.get_current_context()
        verbose = (context.find_root().params.get("verbose") or 0) > 0
        try:
            return command(*args, **kwargs)
        except (TensorsmithError, ValueError) as err:
            if verbose:
                stderr.print_exception()
            hint = getattr(err, "hint", None)
            message = _one_line(getattr(err, "message", str(err)), verbose)
            if kwargs.get("as_json"):
                emit_json({"ok": False, "error": message, "hint": hint, "type": type(err).__name__})
            click.echo(f"error: {message}" + (f" (hint: {hint})" if hint else ""), err=True)
            sys.exit(USAGE if isinstance(err, UsageError) else 1)

    return wrapper


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so that what it holds is released as on an error (temporary
    directories, the staged artifact, engine builders' child processes) before the exit status says SIGTERM."""


def terminable(command: Callable[Params, Result]) -> Callable[Params, Result]:
    """Under SIGTERM (a CI job cancelled, a container stopped) and Ctrl-C: clean up, one line, exit 143 or 130.
    For commands that write files; the server keeps uvicorn's own handling of SIGTERM (drain, then exit)."""

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated()

    @functools.wraps(command)
    def wrapper(*args: Params.args, **kwargs: Params.kwargs) -> Result:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
        try:
            return command(*args, **kwargs)
        except Terminated:
            click.echo("error: terminated (SIGTERM)", err=True)
            sys.exit(TERMINATED)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(INTERRUPTED)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return wrapper


def _one_line(message: str, verbose: bool) -> str:
    """An error is one line: a library message of several lines keeps its first (the rest with -v)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message
    return lines[0] + ("" if verbose else " (more with -v)")


@contextlib.contextmanager
def progress_reporter() -> Iterator[RichReporter | PlainReporter]:
    """Rich progress (stages and counted tasks) on a terminal; plain log lines on stderr otherwise (a CI log)."""
    reporter = RichReporter(stderr) if stderr.is_terminal else PlainReporter()
    with reporter:
        yield reporter
