"""Engine builds with TensorRT for RTX: build time and engine size per target, fp32/fp16 against quantized.

    python bench/build.py [--artifacts build/minilm-targets build/minilm-auto]

Each artifact's variants are built for every architecture that runs them (fp16 for sm_75, fp32 for the others,
int8 for sm_80/86, fp8 for sm_89/120), one build at a time, in this process, twice: into an empty engine cache
(a real build) and again from it (what a second compile gets). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.runner import machine, markdown_table  # noqa: E402

RUNS = {"fp32": ["sm_80", "sm_86", "sm_89", "sm_120"], "fp16": ["sm_75", "sm_86", "sm_89"],
        "int8": ["sm_80", "sm_86", "sm_89", "sm_120"], "fp8": ["sm_89", "sm_120"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--artifacts", nargs="*", type=Path, default=[ROOT / "build" / "minilm-targets", ROOT / "build" / "minilm-auto"]
    )
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    from tensorsmith.compiler.config import BuildConfig, DimRange
    from tensorsmith.compiler.engines.builder import build_engine
    from tensorsmith.compiler.engines.profiles import profile_for
    from tensorsmith.runtime.manifest import read_manifest

    rows = []
    seen = set()
    for artifact in args.artifacts:
        manifest = read_manifest(artifact)
        dims = {name: DimRange(**limits) for name, limits in manifest.dims.items()}
        profile = profile_for(manifest.inputs, dims)
        for variant in manifest.variants:
            if variant.name not in RUNS or variant.name in seen:
                continue
            seen.add(variant.name)
            onnx_mb = (artifact / variant.path).stat().st_size / 1e6
            for target in RUNS[variant.name]:
                with tempfile.TemporaryDirectory() as cache:
                    options = BuildConfig(engine_cache_dir=Path(cache))
                    engine = build_engine(artifact / variant.path, target, profile, options=options)
                    again = build_engine(artifact / variant.path, target, profile, options=options)
                assert engine.cache == "miss" and again.cache == "hit" and again.plan == engine.plan
                rows.append([variant.name, target, f"{onnx_mb:.0f}", f"{len(engine.plan) / 1e6:.1f}",
                             f"{engine.seconds:.2f}", f"{again.seconds:.2f}"])  # fmt: skip
    print(f"{machine()}; TensorRT for RTX, MiniLM, profile batch 1–64 × sequence 1–512\n")
    header = ["variant", "target", "variant MB", "engine MB", "build s", "engine cache hit s"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
