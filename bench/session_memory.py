"""One ONNX Runtime session over a decoder's generation graph (an artifact's model.onnx), in its own process:
resident and peak memory after opening it and after two runs, and the second run's time. With `--twin`, over
the graph's narrow twin (core/narrow_twin: 16-bit weights behind Casts, constant folding off), as the compiler's
measuring sessions open it; `--no-arena` turns ONNX Runtime's CPU arena off too.

    python -m bench.session_memory OUT/model.onnx [--twin] [--no-arena] [--sequence 1]
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np


def resident_gb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 1e9


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def feeds_for(session: object, rows: int, sequence: int, cache: int) -> dict[str, np.ndarray]:
    """A prefill (or, with sequence 1, a decode step) of `rows` rows into an empty static cache of `cache` slots."""
    feeds: dict[str, np.ndarray] = {}
    for value in session.get_inputs():  # type: ignore[attr-defined]
        if value.name == "input_ids":
            feeds[value.name] = np.random.default_rng(0).integers(0, 1000, (rows, sequence))
        elif value.name == "position_ids":
            feeds[value.name] = np.tile(np.arange(sequence), (rows, 1))
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((rows, cache), np.int64)
        elif value.name == "write_indices":
            feeds[value.name] = np.zeros((rows,), np.int64)
        else:  # a past key or value: [rows, kv heads, cache, head dim]
            feeds[value.name] = np.zeros((rows, value.shape[1], cache, value.shape[3]), np.float32)
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--twin", action="store_true")
    parser.add_argument("--no-arena", action="store_true")
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4)
    arguments = parser.parse_args()

    import onnxruntime

    from tensorsmith.core import narrow_twin

    path, disabled = arguments.model, []
    if arguments.twin:
        narrow_twin.SAVES_AT_LEAST = 0
        twin = narrow_twin.write_twin(path)
        assert twin is not None, f"{path} has no weights in external data"
        path, disabled = twin, list(narrow_twin.TWIN_DISABLED_OPTIMIZERS)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.enable_cpu_mem_arena = not arguments.no_arena
    base = resident_gb()
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                           disabled_optimizers=disabled)  # fmt: skip
    print(f"base {base:.2f} GB; opened: resident {resident_gb():.2f} GB, peak {peak_gb():.2f} GB")
    feeds = feeds_for(session, arguments.rows, arguments.sequence, max(256, arguments.sequence))
    for run in range(2):
        started = time.perf_counter()
        session.run(None, feeds)
        print(f"run {run}: {time.perf_counter() - started:.2f} s, resident {resident_gb():.2f} GB, "
              f"peak {peak_gb():.2f} GB")  # fmt: skip
    if arguments.twin:
        narrow_twin.drop_twin(arguments.model)


if __name__ == "__main__":
    main()
