"""`tensorsmith inspect`: a summary of an artifact directory or of an ONNX file, as a dict for --json."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from tensorsmith.core.errors import ConfigError
from tensorsmith.core.ir import ai_onnx_opset, io_records, load_onnx
from tensorsmith.runtime.manifest import read_manifest


def inspect_onnx(path: Path) -> dict[str, Any]:
    model = load_onnx(path)
    io = io_records(model)
    inputs, outputs = io.inputs, io.outputs
    parameters = sum(math.prod(init.dims) for init in model.graph.initializer)
    return {
        "kind": "onnx",
        "path": str(path),
        "opset": ai_onnx_opset(model),
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "nodes": len(model.graph.node),
        "parameters": parameters,
        "bytes": path.stat().st_size,
        "inputs": [record.model_dump() for record in inputs],
        "outputs": [record.model_dump() for record in outputs],
        "ops": dict(Counter(node.op_type for node in model.graph.node).most_common()),
    }


def inspect_artifact(directory: Path) -> dict[str, Any]:
    manifest = read_manifest(directory)
    return {"kind": "artifact", "path": str(directory), **manifest.model_dump(mode="json")}


def inspect_path(path: Path) -> dict[str, Any]:
    if path.is_dir():
        return inspect_artifact(path)
    if path.suffix == ".onnx":
        return inspect_onnx(path)
    raise ConfigError(f"{path} is neither an artifact directory nor an .onnx file", hint="pass OUT or MODEL.onnx")
