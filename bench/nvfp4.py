"""NVFP4 weight-only against INT4 (RTN and AWQ) on the tinylm decoder: perplexity ratio on the held-out windows
and the GPU variant's file size, each compile as its own process (`tensorsmith compile ... --json`).

NVFP4's accuracy is measured on a graph holding the same dequantized weights in fp32 (ONNX Runtime has no
FLOAT4E2M1 DequantizeLinear); its engine is built for sm_120 with tensorrt-rtx, INT4's for sm_86.

    python bench/nvfp4.py            # prints a markdown table
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINYLM = ROOT / "samples" / "tinylm"
CASES = {
    "nvfp4 (sm_120)": ["--precision", "nvfp4", "--target", "sm_120"],
    "int4 rtn block 128 (sm_86)": ["--precision", "int4", "--int4-algorithm", "rtn", "--target", "sm_86"],
    "int4 awq block 128 (sm_86)": ["--precision", "int4", "--target", "sm_86"],
    "int4 awq block 32 (sm_86)": ["--precision", "int4", "--int4-block-size", "32", "--target", "sm_86"],
    "fp16 (sm_86)": ["--precision", "fp16", "--target", "sm_86"],
}


def main() -> None:
    import pydoc_data.topics

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "calibration.txt"
        text.write_text("\n".join(list(pydoc_data.topics.topics.values())[:60]), encoding="utf-8")
        for name, flags in CASES.items():
            out = Path(scratch) / name.split()[0]
            start = time.perf_counter()
            printed = subprocess.run(
                [sys.executable, "-m", "tensorsmith.cli.main", "compile", str(TINYLM / "tensorsmith.toml"), "-o",
                 str(out), "--calibration", str(text), *flags, "--json"], capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            wall = time.perf_counter() - start
            result = json.loads(printed[printed.index("\n{") + 1 :] if not printed.startswith("{") else printed)
            (target,) = [t for t in result["targets"] if t["name"] != "cpu"]
            variant = next(v for v in result["variants"] if v["name"] == target["variant"])
            size = (out / variant["path"]).stat().st_size if variant.get("path") else 0
            rows.append((name, variant["accuracy"].get("perplexity-ratio"), size / 1e6, target["status"], wall))
    print("| variant | perplexity ratio (64 held-out windows) | file MB | engine | compile s |")
    print("|---|---|---|---|---|")
    for name, ratio, size, status, wall in rows:
        print(f"| {name} | {ratio:.4f} | {size:.2f} | {status} | {wall:.0f} |")


if __name__ == "__main__":
    main()
