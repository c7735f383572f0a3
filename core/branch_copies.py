"""Copies of one weight in the branches of an If written once.

A mixture of experts' layer holds its stacked experts in both branches of its If (compiler/frontend/
routed_experts.py: one gathers the chosen experts' weights, the other multiplies every expert), and the exporter
writes each branch's weights as that branch's own initializers: two copies of every expert. onnx-graphsurgeon
exports a constant into each graph that reads it, so the copies cannot move to the outer graph; instead the save
points both at the same bytes of the `.data` file (core/mapped_save.py). ONNX Runtime maps external data, so
the two initializers share their pages too: a session holds the experts once (checked: two branch initializers
of 200 MB at one offset, 297 MB peak RSS against 273 MB for one outer-scope initializer).
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.mapped_graph import INLINE_BELOW, MappedValues

HASH_BLOCK = 64 << 20  # bytes hashed at a time


def share_branch_copies(graph: gs.Graph) -> int:
    """Make the large constants that only subgraphs of `graph` read, and that hold the same values, share one
    values object (the first one's); how many now share another's."""
    outer = {id(tensor) for tensor in graph.tensors().values()}
    groups: dict[tuple[str, tuple[int, ...]], dict[int, gs.Constant]] = {}
    for sub in graph.subgraphs(recursive=True):
        for tensor in sub.tensors().values():
            if isinstance(tensor, gs.Constant) and id(tensor) not in outer and _shareable(tensor):
                groups.setdefault((str(tensor.dtype), tuple(tensor.shape)), {})[id(tensor)] = tensor
    shared = 0
    for group in groups.values():
        if len(group) < 2:  # only constants of one type and shape can be copies: no other is read
            continue
        first_of: dict[bytes, gs.Constant] = {}
        for constant in group.values():
            first = first_of.setdefault(_digest(constant), constant)
            if first is not constant and first._values is not constant._values:
                constant._values = first._values
                shared += 1
    return shared


def _shareable(constant: gs.Constant) -> bool:
    values = constant._values
    return isinstance(values, (MappedValues, np.ndarray)) and values.nbytes >= INLINE_BELOW


def _digest(constant: gs.Constant) -> bytes:
    """A hash of the constant's bytes as stored, read a block at a time."""
    values = constant._values
    stored = values.stored() if isinstance(values, MappedValues) else np.ascontiguousarray(values)
    flat = stored.reshape(-1).view(np.uint8)
    digest = hashlib.blake2b(digest_size=32)
    for start in range(0, flat.size, HASH_BLOCK):
        digest.update(flat[start : start + HASH_BLOCK].data)
    return digest.digest()
