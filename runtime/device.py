"""What this machine can run: the CUDA device's compute capability and the TensorRT flavours installed.

Detected lazily, through whichever of NVML (pynvml), cuda-python or torch is installed, in that order (torch
last: importing it is slow, and services that use tensorsmith's runtime rarely need it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# TensorRT flavour (as the manifest names builders) → (module, distribution)
FLAVOURS = {"tensorrt": ("tensorrt", "tensorrt"), "tensorrt-rtx": ("tensorrt_rtx", "tensorrt-rtx")}
NO_DEVICE = "no CUDA device"


@dataclass(frozen=True)
class Device:
    compute_capability: str | None  # e.g. "sm_89"; None without a CUDA device
    name: str = ""
    tensorrt: dict[str, str] = field(default_factory=dict)  # installed flavour → version
    reason: str = ""  # why there is no device, when there is none


def _from_nvml() -> tuple[str, str] | None:
    import pynvml

    pynvml.nvmlInit()
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        return f"sm_{major}{minor}", name.decode() if isinstance(name, bytes) else str(name)
    finally:
        pynvml.nvmlShutdown()


def _from_cuda_python() -> tuple[str, str] | None:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        from cuda import cudart
    error, count = cudart.cudaGetDeviceCount()
    if int(error) != 0 or count == 0:
        return None
    error, properties = cudart.cudaGetDeviceProperties(0)
    if int(error) != 0:
        return None
    name = properties.name.decode(errors="replace").rstrip("\x00") if isinstance(properties.name, bytes) else ""
    return f"sm_{properties.major}{properties.minor}", name


def _from_torch() -> tuple[str, str] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm_{major}{minor}", torch.cuda.get_device_name(0)


PROBES = (("pynvml", _from_nvml), ("cuda", _from_cuda_python), ("torch", _from_torch))


def module_installed(name: str) -> bool:
    """Importable as a real module: a directory of type stubs (tensorrt-stubs installs `tensorrt/__init__.pyi`)
    would otherwise pass for an installed TensorRT as a namespace package."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


def installed_tensorrt() -> dict[str, str]:
    found = {}
    for flavour, (module, distribution) in FLAVOURS.items():
        if not module_installed(module):
            continue
        try:
            found[flavour] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            found[flavour] = str(getattr(importlib.import_module(module), "__version__", "unknown"))
    return found


def detect_device() -> Device:
    tensorrt = installed_tensorrt()
    tried = []
    for module, probe in PROBES:
        if not module_installed(module):
            continue
        tried.append(module)
        try:
            found = probe()
        except Exception as err:  # a driver-less machine makes these raise their own errors
            logger.debug("%s found no device: %s", module, err)
            continue
        if found is not None:
            return Device(found[0], found[1], tensorrt)
    how = f" (asked {', '.join(tried)})" if tried else " (none of pynvml, cuda-python, torch is installed)"
    return Device(None, tensorrt=tensorrt, reason=NO_DEVICE + how)
