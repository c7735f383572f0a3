"""Which PyTorch module each ONNX node came from, kept through the passes (onnx-graphsurgeon drops node
metadata), so a precision plan reads against the model's code."""

from __future__ import annotations

import ast

import onnx

MODULE_KEY = "tensorsmith.module"  # the node metadata_props key that carries a node's module path
NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # written by torch's dynamo exporter


def module_path_from_name(name: str) -> str:
    """TorchScript-style node names carry the module path: '/layers.0/attention/query/MatMul' → its module."""
    parts = [part for part in name.split("/") if part]
    return ".".join(parts[:-1])


def module_paths(model: onnx.ModelProto) -> dict[str, str]:
    """node name → module path, from the dynamo exporter's name scopes or TorchScript-style node names."""
    paths = {}
    for node in model.graph.node:
        metadata = {entry.key: entry.value for entry in node.metadata_props}
        if NAME_SCOPES in metadata:
            try:
                scopes = [scope for scope in ast.literal_eval(metadata[NAME_SCOPES])[:-1] if scope]
            except (ValueError, SyntaxError):
                scopes = []
            paths[node.name] = scopes[-1] if scopes else ""
        elif node.name.startswith("/"):
            paths[node.name] = module_path_from_name(node.name)
    return paths


def attach_module_paths(model: onnx.ModelProto, paths: dict[str, str]) -> None:
    for node in model.graph.node:
        path = paths.get(node.name)
        if path:
            node.metadata_props.add(key=MODULE_KEY, value=path)


def module_paths_recorded(model: onnx.ModelProto) -> dict[str, str]:
    """The paths `attach_module_paths` wrote, to carry them through another onnx-graphsurgeon round trip."""
    return {
        node.name: entry.value for node in model.graph.node for entry in node.metadata_props if entry.key == MODULE_KEY
    }
