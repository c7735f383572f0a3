"""Run an engine build in a child process, so that a crash inside TensorRT fails one target, not the compile.

TensorRT's builder is native code; on some graphs it dies with a signal (TensorRT for RTX 1.x segfaults on
silero-vad's If-less export, docs/benchmarks.md). In the compiler's own process that would end the whole compile
with no message and no manifest. In a spawned child (0.4 s to start: it imports the builder and TensorRT, nothing
else) it becomes a BuildError naming the signal, recorded on that target like any other build failure.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from tensorsmith.core.errors import BuildError
from tensorsmith.runtime.errors import TensorsmithError

logger = logging.getLogger(__name__)

Result = TypeVar("Result")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies


def run_isolated(function: Callable[..., Result], args: tuple[Any, ...], what: str) -> Result:
    """`function(*args)` in a spawned child; its BuildError (or any error) comes back as a BuildError, and a child
    that dies (a signal, an exit) is one too, naming `what` it was doing."""
    context = multiprocessing.get_context("spawn")  # not fork: the parent has ONNX Runtime's and torch's threads
    receiver, sender = context.Pipe(duplex=False)
    level = logging.getLogger("tensorsmith").getEffectiveLevel()
    process = context.Process(target=_child, args=(sender, function, args, level), daemon=True)
    process.start()
    sender.close()
    try:
        status, payload = receiver.recv()
    except EOFError:
        process.join()
        code = process.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        raise BuildError(
            f"TensorRT crashed while {what} ({how})",
            hint="a builder bug on this graph: try another --opset, or exclude the target; the CPU variant runs",
        ) from None
    finally:
        if process.is_alive():
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        receiver.close()
    if status == "error":
        message, hint = payload
        raise BuildError(message, hint=hint)
    return payload


def _child(sender: Connection, function: Callable[..., Any], args: tuple[Any, ...], level: int) -> None:
    if sys.platform.startswith("linux"):  # end with the compile, even when it is killed (SIGKILL skips cleanup)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    try:
        result: tuple[str, Any] = ("ok", function(*args))
    except TensorsmithError as err:
        result = ("error", (err.message, err.hint))
    except Exception as err:  # whatever the bindings raise; the parent words it as a BuildError
        result = ("error", (f"{type(err).__name__}: {err}", None))
    sender.send(result)
    sender.close()
