"""Where ONNX Runtime spends its time on a CPU variant: kernel time per op type, from its own profiler.

    python bench/cpu_profile.py [--artifact build/minilm-auto] [--runs 20]

Profiles, on batch 8 × 64 tokens with 2 threads, the artifact's cpu variant (with the ONNX Runtime optimizers
its manifest switches off) and ONNX Runtime's dynamic quantization (MatMul, per-channel) of the artifact's fp32
graph, with ONNX Runtime's defaults and with the same optimizers off. Prints a markdown table (ms per run).
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
from tensorsmith.core.timing import cpu_session  # noqa: E402


def kernel_ms(
    models: dict[str, tuple[Path, list[str]]], feeds: dict[str, np.ndarray], runs: int, scratch: Path
) -> dict[str, dict[str, float]]:
    """Kernel ms per op type and run for each (model, optimizers switched off), the runs interleaved so that
    drift in the machine's speed hits every model alike; threads stop spinning after each run."""
    sessions = {
        name: cpu_session(path, disabled, threads=2, profile=scratch / f"profile-{index}")
        for index, (name, (path, disabled)) in enumerate(models.items())
    }
    for _ in range(runs):
        for session in sessions.values():
            session.run(None, feeds)
    columns = {}
    for name, session in sessions.items():
        totals: collections.Counter[str] = collections.Counter()
        for event in json.loads(Path(session.end_profiling()).read_text()):
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                totals[event["args"]["op_name"]] += event["dur"]
        columns[name] = {op: microseconds / runs / 1000 for op, microseconds in totals.items()}
    return columns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=ROOT / "build" / "minilm-auto")
    parser.add_argument("--feeds", type=Path, default=ROOT / "samples" / "minilm" / "evaluation.npz")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    manifest = json.loads((args.artifact / "manifest.json").read_text())
    cpu = next(target for target in manifest["targets"] if target["name"] == "cpu")
    variant = next(v for v in manifest["variants"] if v["name"] == cpu["variant"])
    ours, tuned = args.artifact / variant["path"], variant.get("onnxruntime_disabled_optimizers", [])
    without = f", without {', '.join(tuned)}" if tuned else ""
    with np.load(args.feeds) as archive:
        feeds = {name: archive[name][:8] for name in archive.files}
    with tempfile.TemporaryDirectory() as scratch:
        anchor = Path(scratch) / "dynamic-per-channel.onnx"
        onnxruntime_dynamic_per_channel(args.artifact / "model.onnx", anchor)
        runs: dict[str, tuple[Path, list[str]]] = {"onnxruntime dynamic (MatMul, per-channel)": (anchor, [])}
        if tuned:
            runs[f"onnxruntime dynamic (MatMul, per-channel){without}"] = (anchor, tuned)
        runs[f"tensorsmith {cpu['variant']}{without}"] = (ours, tuned)
        columns = kernel_ms(runs, feeds, args.runs, Path(scratch))
    ops = sorted(set().union(*columns.values()), key=lambda op: -max(c.get(op, 0.0) for c in columns.values()))
    rows = [[op, *(f"{c.get(op, 0.0):.2f}" for c in columns.values())] for op in ops if max(
        c.get(op, 0.0) for c in columns.values()) >= 0.05]  # fmt: skip
    rows.append(["total", *(f"{sum(c.values()):.2f}" for c in columns.values())])
    runs_text = f"{args.runs} interleaved profiled runs"
    print(f"{machine()}; MiniLM, batch 8 × 64 tokens, 2 threads, {runs_text}; kernel ms per run\n")
    print(markdown_table(["op", *columns], rows))


if __name__ == "__main__":
    main()
