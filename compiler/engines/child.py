"""The child process of compiler/engines/isolated.py: unpickle (function, args), call it, pickle the answer.

python -m tensorsmith.compiler.engines.child REQUEST ANSWER LOG_LEVEL
"""

from __future__ import annotations

import ctypes
import logging
import pickle
import signal
import sys
from pathlib import Path
from typing import Any

from tensorsmith.runtime.errors import TensorsmithError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies


def main(request: Path, answer: Path, level: int) -> None:
    if sys.platform.startswith("linux"):  # end with the compile, even when it is killed (SIGKILL skips cleanup)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    function, args = pickle.loads(request.read_bytes())
    try:
        result: tuple[str, Any] = ("ok", function(*args))
    except TensorsmithError as err:
        result = ("error", (err.message, err.hint))
    except Exception as err:  # whatever the bindings raise; the parent words it as a BuildError
        result = ("error", (f"{type(err).__name__}: {err}", None))
    # whole or not at all: a child that dies while writing leaves no answer, which the parent reports as a crash
    partial = answer.with_name(answer.name + ".partial")
    partial.write_bytes(pickle.dumps(result))
    partial.replace(answer)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
