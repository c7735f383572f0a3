"""The ONNX corpus table of docs/benchmarks.md: each real file from another exporter (tests/compiler/
test_onnx_corpus.py's CORPUS), compiled as a user would, `tensorsmith compile TOML -o OUT --target cpu
--target sm_86 --json` in its own process, with its wall clock and peak RSS; then parity against the file as
shipped on ONNX Runtime, at the verification sizes.

    .venv/bin/python bench/onnx_corpus.py            # prints the Markdown table
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tensorsmith.compiler import CompileConfig  # noqa: E402
from tensorsmith.compiler.frontend.feeds import example_feeds  # noqa: E402
from tensorsmith.compiler.frontend.source import open_source  # noqa: E402
from tensorsmith.runtime import load  # noqa: E402
from tests.compiler.test_onnx_corpus import CORPUS, CorpusFile  # noqa: E402


def _toml(entry: CorpusFile, path: Path) -> Path:
    """The settings as a tensorsmith.toml (what a user writes), without a TOML writer dependency."""
    lines = [f"source = {json.dumps(str(entry.file()))}"]
    for decl in entry.settings.get("inputs", []):  # type: ignore[attr-defined]
        lines += ["[[inputs]]", *(f"{key} = {json.dumps(value)}" for key, value in decl.items())]
    for name, limits in entry.settings.get("dims", {}).items():  # type: ignore[attr-defined]
        lines += [f"[dims.{json.dumps(name)}]", *(f"{key} = {value}" for key, value in limits.items())]
    path.write_text("\n".join(lines) + "\n")
    tomllib.loads(path.read_text())  # fails here, not in the compile, if the writer above is wrong
    return path


def _written(model: onnx.ModelProto) -> str:
    shapes = []
    for value in model.graph.input:
        dims = []
        for dim in value.type.tensor_type.shape.dim:
            dims.append(
                str(dim.dim_value) if dim.HasField("dim_value") else repr(dim.dim_param) if dim.dim_param else "?"
            )
        shapes.append(f"`{value.name}` [{', '.join(dims)}]")
    return "; ".join(shapes)


def _row(name: str, entry: CorpusFile, scratch: Path) -> str:
    source = entry.file()
    model = onnx.load(str(source))
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    toml = _toml(entry, scratch / f"{len(list(scratch.iterdir()))}.toml")
    out = scratch / f"out-{toml.stem}"
    command = [str(Path(sys.executable).with_name("tensorsmith")), "compile", str(toml), "-o", str(out),
               "--target", "cpu", "--target", "sm_86", "--json"]  # fmt: skip
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)  # this child's own peak RSS (KB on Linux)
    seconds = time.perf_counter() - started
    peak_mb, exit_code = usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)
    manifest = json.loads((out / "manifest.json").read_text())
    config = CompileConfig.create({"source": str(source), **entry.settings})
    feeds = example_feeds(open_source(config).config, seed=7)
    expected = onnxruntime.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, feeds)
    with load(out, backend="onnxruntime") as compiled:
        actual = list(compiled.run(feeds).values())
    parity = max(
        float(np.max(np.abs(a.astype(np.float64) - e)) / max(float(np.max(np.abs(e))), 1e-30))
        for e, a in zip(expected, actual, strict=True)
    )
    canonical = next(p for p in manifest["passes"] if p["name"] == "canonicalize")["counts"]
    fused = {k.removesuffix(".matched"): v for p in manifest["passes"] for k, v in p["counts"].items()
             if k.endswith(".matched") and v}  # fmt: skip
    inputs = "; ".join(f"`{r['name']}` [{', '.join(map(str, r['shape']))}]" for r in manifest["inputs"])
    did = [f"inputs {inputs}"]
    if manifest["dim_names"]:
        did.append("renamed " + ", ".join(f"`{v}` → `{k}`" for k, v in manifest["dim_names"].items()))
    if manifest["default_dims"]:
        did.append("default range for " + ", ".join(f"`{d}`" for d in manifest["default_dims"]))
    engine = next(t for t in manifest["targets"] if t["name"] == "sm_86")
    build = "built" if engine["status"] == "built" else f"**{engine['status']}**: {engine['reason'][:90]}…"
    return (
        f"| {name} | {model.producer_name or '(empty)'} {model.producer_version} | {opset} | {_written(model)} | "
        f"{'; '.join(did)} | nodes {canonical['nodes_before']} → {canonical['nodes_after']}"
        f"{'; ' + ', '.join(f'{k} ×{v}' for k, v in fused.items()) if fused else ''} | {parity:.1e} | {build} | "
        f"{seconds:.1f} s, {peak_mb:.0f} MB (exit {exit_code}) |"
    )


def main() -> None:
    logging.disable(logging.WARNING)  # the in-process parity run repeats the compile's own warnings
    print("| file (exporter) | producer as written | opset | dims as written | what the compile did | canonicalize; "
          "fusions | parity (max rel. error) | sm_86 (TensorRT-RTX) | compile (wall, peak RSS) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="tensorsmith-corpus-") as scratch:
        for name, entry in CORPUS.items():
            print(_row(name, entry, Path(scratch)), flush=True)


if __name__ == "__main__":
    main()
