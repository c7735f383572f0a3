"""What the export hands on: the ONNX model, which exporter made it, and the source's reference computation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx

if TYPE_CHECKING:
    import torch

Reference = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


@dataclass
class ExportedModel:
    model: onnx.ModelProto
    exporter: str  # "dynamo", "torchscript" or "none" (an ONNX source)
    fallback_reason: str | None = None
    # Computes the source model's outputs for feeds, to verify the compiled graph against (None for ONNX).
    reference: Reference | None = None
    warnings: list[str] = field(default_factory=list)  # torch's and onnx's, during the export (for the manifest)
    traced_layers: int | None = None  # a decoder's layers traced, the rest stamped from them (None: all traced)


def _flatten(value: object) -> Iterator[torch.Tensor]:
    """The tensors of a model's output, in order: a tensor, tuple/list, dict, or a HF-style ModelOutput."""
    import torch

    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _flatten(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flatten(item)
    elif isinstance(value, torch.Tensor):
        yield value
    elif value is not None:
        raise TypeError(f"the model's output holds a {type(value).__name__}, not a tensor")


def torch_reference(module: Callable[..., object], names: list[str]) -> Reference:
    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        with torch.inference_mode():
            outputs = module(*(torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in names))
        return [tensor.detach().cpu().numpy() for tensor in _flatten(outputs)]

    return run
