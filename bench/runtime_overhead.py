"""What tensorsmith's runtime costs over a bare ONNX Runtime session, on the compiled MiniLM sample.

    python bench/runtime_overhead.py [--artifact build/minilm] [--batch 8] [--repeats 30]

Both run the same model.onnx on the CPU provider with the same feeds (held-out sentences) and the same ONNX
Runtime optimizers switched off (the ones the manifest records for the cpu target's variant), so the table
shows what the runtime adds: input checks and the dict in/out. Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.runner import compare, machine, markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=Path("build/minilm"))
    parser.add_argument("--feeds", type=Path, default=Path("samples/minilm/evaluation.npz"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    import onnxruntime

    from tensorsmith.runtime import load

    with np.load(args.feeds) as archive:
        feeds = {name: archive[name][: args.batch] for name in archive.files}
    with load(args.artifact, backend="onnxruntime") as model:
        disabled = model._backend.disabled_optimizers  # type: ignore[attr-defined]
        session = onnxruntime.InferenceSession(
            str(args.artifact / "model.onnx"), providers=["CPUExecutionProvider"], disabled_optimizers=disabled
        )
        np.testing.assert_array_equal(session.run(None, feeds)[1], model.run(feeds)["sentence_embedding"])
        timings, ratios = compare(
            {
                "onnxruntime InferenceSession.run": lambda: session.run(None, feeds),
                "tensorsmith load().run": lambda: model.run(feeds),
            },
            repeats=args.repeats,
        )
    shape = "×".join(str(d) for d in feeds["input_ids"].shape)
    rows = [[name, shape, timing.summary(), f"{ratios.get(name, 1.0):.3f}"] for name, timing in timings.items()]
    switched_off = ", ".join(disabled) or "none"
    print(f"MiniLM fp32, CPU provider, {machine()}, {args.repeats} interleaved runs, optimizers off: {switched_off}\n")
    print(markdown_table(["runner", "batch×sequence", "ms min / median / max", "ratio to ORT"], rows))


if __name__ == "__main__":
    main()
