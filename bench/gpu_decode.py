"""The GPU table of issue 25 (item 6), for scripts/gpu-check.sh: one call, one table.

    .venv/bin/python -m bench.gpu_decode ARTIFACT [ARTIFACT ...] [--batches 1 8] [--contexts 128 1024]

Each ARTIFACT is a decoder compiled for the cpu and this GPU (fp16, INT4, ...). Per artifact:

- greedy tokens of its TensorRT engine against ONNX Runtime's on the cpu variant (64-token prompt, 32 new);
- per batch and context: decode tokens/s, the decode step timed on the request's device cache
  (`open_cache`, one-token `StepFeeds`, the host's argmax between steps as `generate` does);
- the bytes each decode step handed to the CUDA API's copies (the session's CopyMeter, counted at the
  cudaMemcpy*Async calls) against runtime/copy_plan.py's plan;
- the bandwidth bound: rows ÷ ((engine bytes + cache bytes read per step) ÷ memory bandwidth), the bandwidth
  from the memory clock and bus width (cudaDeviceGetAttribute), and the measured rate as a share of it. A
  static cache is read at its whole length each step (the mask hides the empty slots, the kernel still reads
  them), so the cache bytes are those of the engine's capacity, not of the context.

The pure parts (the bound, the table) are tested without a GPU (tests/runtime/test_tensorrt_cache.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROMPT, NEW_TOKENS = 64, 32


# --------------------------------------------------------------------------------------------------------------
# Pure parts


def peak_bandwidth(memory_clock_khz: int, bus_width_bits: int) -> float:
    """Bytes/s from cudaDevAttrMemoryClockRate (kHz) and cudaDevAttrGlobalMemoryBusWidth (bits): double data
    rate, as NVIDIA's deviceQuery sample computes it."""
    return 2.0 * memory_clock_khz * 1e3 * bus_width_bits / 8


def cache_bytes_read(layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int, itemsize: int) -> int:
    """Every key and value of every layer at the cache's whole length: what attention reads in one step."""
    return 2 * layers * rows * kv_heads * capacity * head_dim * itemsize


def bound_tokens_per_second(rows: int, weight_bytes: int, cache_bytes: int, bandwidth: float) -> float:
    """Tokens/s if a decode step cost only reading the weights and the cache once at `bandwidth` bytes/s."""
    return rows * bandwidth / (weight_bytes + cache_bytes)


@dataclass(frozen=True)
class DecodeRow:
    artifact: str
    batch: int
    context: int
    capacity: int
    tokens_per_second: float | None  # None: not measured (`note` says why)
    to_device: int = 0  # bytes per decode step, as handed to the CUDA API
    to_host: int = 0
    plan_agrees: bool = False
    bound: float | None = None  # tokens/s at the bandwidth bound
    note: str = ""

    @property
    def share_of_bound(self) -> float | None:
        if self.tokens_per_second is None or not self.bound:
            return None
        return self.tokens_per_second / self.bound


def table(rows: list[DecodeRow]) -> str:
    """The Markdown table of the decode rows."""
    header = ["artifact", "batch", "context", "capacity", "decode tokens/s", "bytes/step h→d", "bytes/step d→h",
              "= plan", "bound tokens/s", "share of bound", "note"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---|"]
    for row in rows:
        cells = [row.artifact, str(row.batch), str(row.context), str(row.capacity)]
        if row.tokens_per_second is None:
            cells += [""] * 6
        else:
            share = row.share_of_bound
            cells += [f"{row.tokens_per_second:,.0f}", f"{row.to_device:,}", f"{row.to_host:,}",
                      "yes" if row.plan_agrees else "NO", f"{row.bound:,.0f}" if row.bound else "",
                      f"{share:.0%}" if share is not None else ""]  # fmt: skip
        lines.append("| " + " | ".join([*cells, row.note]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# On the GPU


def memory_bandwidth() -> tuple[float | None, str]:
    """The device's peak memory bandwidth (bytes/s) and how it was found."""
    from tensorsmith.runtime.errors import RuntimeLoadError
    from tensorsmith.runtime.tensorrt_backend import _cudart

    try:
        cudart = _cudart()
        attribute = cudart.cudaDeviceAttr
        clock = cudart.cudaDeviceGetAttribute(attribute.cudaDevAttrMemoryClockRate, 0)
        width = cudart.cudaDeviceGetAttribute(attribute.cudaDevAttrGlobalMemoryBusWidth, 0)
        if int(clock[0]) == 0 and int(width[0]) == 0 and clock[1] > 0 and width[1] > 0:
            return peak_bandwidth(int(clock[1]), int(width[1])), f"{clock[1] / 1e3:.0f} MHz × {width[1]} bits"
        reason = f"cudaDeviceGetAttribute answered {clock[0]}, {width[0]}"
    except (RuntimeLoadError, AttributeError) as err:  # no cuda-python, or a CUDA without the attributes
        reason = str(err)
    return None, f"not known ({reason})"


def greedy_check(artifact: Path) -> str:
    """A VERIFIED / NOT VERIFIED line: the engine's greedy tokens against ONNX Runtime's on the cpu variant."""
    from tensorsmith.runtime import load

    prompt = np.arange(3, 3 + PROMPT, dtype=np.int64)[None]
    with load(artifact, backend="onnxruntime") as reference, load(artifact, backend="tensorrt") as model:
        expected = reference.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[])
        actual = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[])
        differ = int((expected[:, PROMPT:] != actual[:, PROMPT:]).sum())
        verdict = "VERIFIED" if differ == 0 else "NOT VERIFIED"
        return (f"{verdict}: {artifact.name} greedy tokens on {model.backend} against ONNX Runtime "
                f"({reference.backend}): {differ} of {NEW_TOKENS} differ")  # fmt: skip


def engine_bytes(artifact: Path) -> int:
    from tensorsmith.runtime import detect_device
    from tensorsmith.runtime.manifest import read_manifest
    from tensorsmith.runtime.selection import select_engine

    selection = select_engine(read_manifest(artifact), detect_device(), artifact)
    return selection.path.stat().st_size if selection.path is not None else 0


def decode_rows(artifact: Path, batches: list[int], contexts: list[int], steps: int, bandwidth: float | None,
                backend_name: str = "tensorrt") -> list[DecodeRow]:  # fmt: skip
    """One row per batch and context; `backend_name` onnxruntime runs the same loop on the host (a smoke test)."""
    from tensorsmith.runtime import load
    from tensorsmith.runtime.kv_cache import CacheShape, StepFeeds
    from tensorsmith.runtime.tensorrt_cache import TensorRTStaticCache

    weights = engine_bytes(artifact) if backend_name == "tensorrt" else 0
    rows = []
    with load(artifact, backend=backend_name) as model:
        backend: Any = model._backend
        layout = model.manifest.generation
        assert layout is not None, f"{artifact} is not a decoder"
        past = next(spec for spec in model.inputs if spec.name.startswith("past_key_values."))
        rng = np.random.default_rng(0)
        for batch in batches:
            for context in contexts:
                needed = context + steps + 4
                if needed > layout.max_sequence_length:
                    rows.append(DecodeRow(artifact.name, batch, context, layout.max_sequence_length, None,
                                          note=f"n/a: {needed} slots > {layout.max_sequence_length}"))  # fmt: skip
                    continue
                shape = CacheShape(layout, batch, needed, np.dtype(past.dtype))
                with backend.open_cache(shape, static=layout.kv_cache == "static") as cache:
                    prompt = rng.integers(3, 1000, (batch, context)).astype(np.int64)
                    positions = np.tile(np.arange(context, dtype=np.int64), (batch, 1))
                    logits = cache.step(StepFeeds(prompt, positions, 0, np.ones_like(prompt)))
                    ones = np.ones((batch, 1), np.int64)
                    write = context
                    for timed in (False, True):  # 4 steps to warm up (and capture the graph), then the timed ones
                        started = time.perf_counter()
                        for _ in range(steps if timed else 4):
                            tokens = logits.argmax(-1).astype(np.int64)[:, None]
                            logits = cache.step(StepFeeds(tokens, ones * write, write, ones))
                            write += 1
                        elapsed = time.perf_counter() - started
                    on_device = isinstance(cache, TensorRTStaticCache)
                    capacity = cache.shape.capacity
                    counted = cache.copies[-1] if on_device else None
                    agrees = on_device and counted is not None and counted.agrees_with(cache.plan(1))
                    itemsize = np.dtype(cache.shape.dtype).itemsize
                read = cache_bytes_read(layout.layers, batch, layout.kv_heads, capacity, layout.head_dim, itemsize)
                rows.append(DecodeRow(
                    artifact.name, batch, context, capacity, batch * steps / elapsed,
                    counted.to_device if counted else 0, counted.to_host if counted else 0, bool(agrees),
                    bound_tokens_per_second(batch, weights, read, bandwidth) if bandwidth and weights else None,
                    "" if on_device else f"cache not on the device ({model.backend})",
                ))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 1024])
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per row")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)

    bandwidth, source = memory_bandwidth()
    print(f"memory bandwidth: {bandwidth / 1e12:.2f} TB/s ({source})" if bandwidth else f"memory bandwidth {source}")
    rows, failed = [], False
    for artifact in args.artifacts:
        try:
            line = greedy_check(artifact)
            print(line)
            failed |= line.startswith("NOT")
            rows += decode_rows(artifact, args.batches, args.contexts, args.steps, bandwidth)
        except Exception as err:  # one artifact's failure is a line of the report, not the end of it
            print(f"NOT VERIFIED: {artifact.name}: {type(err).__name__}: {err}")
            failed = True
    print(table(rows))
    agree = all(row.plan_agrees for row in rows if row.tokens_per_second is not None)
    print(("VERIFIED" if rows and agree else "NOT VERIFIED") + ": bytes copied per decode step equal the copy plan")
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return 1 if failed or not agree else 0


if __name__ == "__main__":
    sys.exit(main())
