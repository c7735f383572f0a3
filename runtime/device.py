"""What this machine can run: the CUDA device's compute capability and the TensorRT flavours installed.

Detected lazily through the CUDA driver itself (libcuda, by ctypes: no Python package needed), then NVML
(pynvml) or cuda-python where the driver library cannot be opened. Never through torch: importing it takes
seconds and hundreds of MB in a service that does not otherwise use it.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
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


DRIVER_LIBRARIES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
COMPUTE_CAPABILITY_MAJOR, COMPUTE_CAPABILITY_MINOR = 75, 76  # CUdevice_attribute values (cuda.h)


class DriverError(RuntimeError):
    """The CUDA driver library is missing or answered with an error code."""


def _open_driver() -> ctypes.CDLL:
    for name in DRIVER_LIBRARIES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise DriverError(f"{' or '.join(DRIVER_LIBRARIES)} not found")


def _from_cuda_driver() -> tuple[str, str] | None:
    """Device 0's compute capability and name from the driver API: cuInit, cuDeviceGetCount, cuDeviceGet,
    cuDeviceGetAttribute, cuDeviceGetName."""
    driver = _open_driver()

    def check(result: int, call: str) -> None:
        if result != 0:  # CUDA_SUCCESS; 100 is CUDA_ERROR_NO_DEVICE
            raise DriverError(f"{call} returned CUDA error {result}")

    check(driver.cuInit(0), "cuInit")
    count = ctypes.c_int(0)
    check(driver.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    if count.value == 0:
        return None
    device = ctypes.c_int(0)
    check(driver.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    check(driver.cuDeviceGetAttribute(ctypes.byref(major), COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute")
    check(driver.cuDeviceGetAttribute(ctypes.byref(minor), COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute")
    name = ctypes.create_string_buffer(256)
    check(driver.cuDeviceGetName(name, len(name), device), "cuDeviceGetName")
    return f"sm_{major.value}{minor.value}", name.value.decode(errors="replace")


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


# (what is asked, the module it needs or None, the probe)
PROBES = (
    ("cuda-driver", None, _from_cuda_driver),
    ("pynvml", "pynvml", _from_nvml),
    ("cuda-python", "cuda", _from_cuda_python),
)


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
    answers = []
    for asked, module, probe in PROBES:
        if module is not None and not module_installed(module):
            continue
        try:
            found = probe()
        except Exception as err:  # a driver-less machine makes these raise their own errors
            logger.debug("%s found no device: %s", asked, err)
            answers.append(f"{asked}: {err}" if isinstance(err, DriverError) else asked)
            continue
        if found is not None:
            return Device(found[0], found[1], tensorrt)
        answers.append(f"{asked}: no device")
    return Device(None, tensorrt=tensorrt, reason=f"{NO_DEVICE} ({'; '.join(answers)})")
