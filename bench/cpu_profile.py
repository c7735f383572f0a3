"""Where ONNX Runtime spends its time on a CPU variant: kernel time per op type, from its own profiler.

    python bench/cpu_profile.py [--artifact build/minilm-auto] [--runs 20]

Profiles, on batch 8 × 64 tokens with 2 threads, the artifact's cpu variant and ONNX Runtime's dynamic
quantization (MatMul, per-channel) of the artifact's fp32 graph. Prints a markdown table (ms per run).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.precision import onnxruntime_dynamic_per_channel  # noqa: E402
from bench.runner import machine, markdown_table  # noqa: E402


def kernel_ms(model: Path, feeds: dict[str, np.ndarray], runs: int, prefix: Path) -> dict[str, float]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = str(prefix)
    session = onnxruntime.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    for _ in range(runs):
        session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    totals: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"]
    return {op: microseconds / runs / 1000 for op, microseconds in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=ROOT / "build" / "minilm-auto")
    parser.add_argument("--feeds", type=Path, default=ROOT / "samples" / "minilm" / "evaluation.npz")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    manifest = json.loads((args.artifact / "manifest.json").read_text())
    cpu = next(target for target in manifest["targets"] if target["name"] == "cpu")
    ours = args.artifact / next(v["path"] for v in manifest["variants"] if v["name"] == cpu["variant"])
    with np.load(args.feeds) as archive:
        feeds = {name: archive[name][:8] for name in archive.files}
    with tempfile.TemporaryDirectory() as scratch:
        anchor = Path(scratch) / "dynamic-per-channel.onnx"
        onnxruntime_dynamic_per_channel(args.artifact / "model.onnx", anchor)
        columns = {
            "onnxruntime dynamic (MatMul, per-channel)": kernel_ms(anchor, feeds, args.runs, Path(scratch) / "a"),
            f"tensorsmith {cpu['variant']}": kernel_ms(ours, feeds, args.runs, Path(scratch) / "b"),
        }
    ops = sorted(set().union(*columns.values()), key=lambda op: -max(c.get(op, 0.0) for c in columns.values()))
    rows = [[op, *(f"{c.get(op, 0.0):.2f}" for c in columns.values())] for op in ops if max(
        c.get(op, 0.0) for c in columns.values()) >= 0.05]  # fmt: skip
    rows.append(["total", *(f"{sum(c.values()):.2f}" for c in columns.values())])
    print(f"{machine()}; MiniLM, batch 8 × 64 tokens, 2 threads, {args.runs} profiled runs; kernel ms per run\n")
    print(markdown_table(["op", *columns], rows))


if __name__ == "__main__":
    main()
