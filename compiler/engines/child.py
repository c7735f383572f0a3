"""The child process of compiler/engines/isolated.py: unpickle (function, args), call it, pickle the answer.

python -m tensorsmith.compiler.engines.child REQUEST ANSWER LOG_LEVEL NATIVE_OUTPUT

TensorRT for RTX prints some warnings itself, on the process's stdout and stderr, past its logger ("in op
node_clamp_min, operand ... payload type requires precision-lose casting"). The child's file descriptors 1 and 2
go to NATIVE_OUTPUT, which the parent logs (shown with -v); the child's own log records keep the real stderr.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
from pathlib import Path

from tensorsmith.runtime.errors import TensorsmithError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies


def main(request: Path, answer: Path, level: int, native: Path) -> None:
    if sys.platform.startswith("linux"):  # end with the compile, even when it is killed (SIGKILL skips cleanup)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=os.fdopen(os.dup(2), "w", buffering=1))
    output = os.open(native, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for descriptor in (1, 2):
        os.dup2(output, descriptor)
    os.close(output)
    function, args = pickle.loads(request.read_bytes())
    try:
        result: tuple[str, object] = ("ok", function(*args))
    except TensorsmithError as err:
        result = ("error", (err.message, err.hint))
    except Exception as err:  # whatever the bindings raise; the parent words it as a BuildError
        result = ("error", (f"{type(err).__name__}: {err}", None))
    # whole or not at all: a child that dies while writing leaves no answer, which the parent reports as a crash
    partial = answer.with_name(answer.name + ".partial")
    partial.write_bytes(pickle.dumps(result))
    partial.replace(answer)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
