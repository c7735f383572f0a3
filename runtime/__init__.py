"""tensorsmith's runtime: load a compiled artifact and run it.

It ships alone: it imports nothing else from tensorsmith, and neither torch nor onnx-graphsurgeon.
"""

from tensorsmith.runtime.batcher import DynamicBatcher
from tensorsmith.runtime.device import Device, detect_device
from tensorsmith.runtime.errors import ArtifactError, InferenceError, InputError, RuntimeLoadError, TensorsmithError
from tensorsmith.runtime.loader import Model, load
from tensorsmith.runtime.selection import Selection, select_engine
from tensorsmith.runtime.specs import TensorSpec

__all__ = [
    "ArtifactError",
    "Device",
    "DynamicBatcher",
    "InferenceError",
    "InputError",
    "Model",
    "RuntimeLoadError",
    "Selection",
    "TensorSpec",
    "TensorsmithError",
    "detect_device",
    "load",
    "select_engine",
]
