"""Run an engine build in a child process, so that a crash inside TensorRT fails one target, not the compile.

TensorRT's builder is native code; on some graphs it dies with a signal (TensorRT for RTX 1.x segfaults on
silero-vad's If-less export, docs/benchmarks.md). In the compiler's own process that would end the whole compile
with no message and no manifest. In a child process (0.4 s to start: it imports the builder and TensorRT, nothing
else) it becomes a BuildError naming the signal, recorded on that target like any other build failure.
"""

from __future__ import annotations

import logging
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tensorsmith.core.errors import BuildError

logger = logging.getLogger(__name__)
Result = TypeVar("Result")
CHILD = "tensorsmith.compiler.engines.child"  # its own module: `-m` of a module the package imports warns


def run_isolated(function: Callable[..., Result], args: tuple[object, ...], what: str) -> Result:
    """`function(*args)` in a child process; its BuildError (or any error) comes back as a BuildError, and a
    child that dies (a signal, an exit) is one too, naming `what` it was doing.

    The child is `python -m tensorsmith.compiler.engines.isolated`, not multiprocessing's spawn: spawn re-runs
    the caller's main script, which breaks any script that calls compile() without an `if __name__` guard."""
    with tempfile.TemporaryDirectory(prefix="tensorsmith-build-") as scratch:
        request, answer = Path(scratch) / "request.pickle", Path(scratch) / "answer.pickle"
        native = Path(scratch) / "native-output.txt"  # what TensorRT prints itself, past its logger
        # our own objects, between our own processes: the pickle never crosses a trust boundary
        request.write_bytes(pickle.dumps((function, args)))
        level = str(logging.getLogger("tensorsmith").getEffectiveLevel())
        command = [sys.executable, "-m", CHILD, str(request), str(answer), level, str(native)]
        code = subprocess.run(command, stdin=subprocess.DEVNULL, check=False).returncode
        _log_native_output(native, what)
        try:
            status, payload = pickle.loads(answer.read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError) as err:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise BuildError(
                f"TensorRT crashed while {what} ({how})",
                hint="a builder bug on this graph: try another --opset, or exclude the target; the CPU variant runs",
            ) from err
    if status == "error":
        message, hint = payload
        raise BuildError(message, hint=hint)
    return payload


def _log_native_output(path: Path, what: str) -> None:
    """The lines the child's libraries printed, logged (seen with -v): never raw on the user's console."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return
    for line in filter(None, (line.strip() for line in lines)):
        logger.info("%s: %s", what, line)
