"""Compile time of each sample against the bare exporter it wraps, in the same process and run.

    python bench/compile_samples.py [--samples tiny_bert cnn moe minilm]

"bare export" is `torch.onnx.export(dynamo=True)` on the same module and example inputs, which is what a user
would otherwise run; tensorsmith adds the canonicalize pass, verification on ONNX Runtime, and the artifact.
Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.runner import machine, markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", nargs="*", default=["tiny_bert", "cnn", "moe", "minilm"])
    args = parser.parse_args()

    from tensorsmith.compiler import CompileConfig, compile
    from tensorsmith.compiler.frontend.export import _build_module
    from tensorsmith.compiler.frontend.exporters import export_dynamo
    from tensorsmith.compiler.frontend.feeds import example_feeds
    from tensorsmith.samples import prepare

    rows = []
    for name in args.samples:
        prepare.prepare(name)
        config = CompileConfig.from_toml(prepare.SAMPLES / name / "tensorsmith.toml")
        feeds = example_feeds(config)
        module = _build_module(config)
        export_dynamo(module, config, feeds, config.outputs or None, [])  # warm-up: imports, dispatcher caches
        started = time.perf_counter()
        export_dynamo(_build_module(config), config, feeds, config.outputs or None, [])
        bare = time.perf_counter() - started
        with tempfile.TemporaryDirectory() as scratch:
            result = compile(config, Path(scratch) / name)
        passes = sum(record.seconds for record in result.manifest.passes)
        rows.append([name, f"{bare:.1f}", f"{result.seconds:.1f}", f"{passes:.2f}", f"{result.seconds / bare:.2f}"])
    print(f"{machine()}; one warm-up export, then one timed run of each\n")
    print(markdown_table(["sample", "bare export s", "tensorsmith compile s", "passes s", "ratio"], rows))


if __name__ == "__main__":
    main()
