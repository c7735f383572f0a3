"""The backends, one row each: what `load()` tries, the CLI offers, the compile times and the manifest records.

A row names a backend as the manifest, the CLI and `load(backend=...)` spell it and as people write it, says what it
runs (the TensorRT engine built for the device, or the cpu target's variant), and names the module that opens it.
That module is imported only when its row is tried (OpenVINO and TensorRT are optional installs) and provides

    open_backend(artifact: runtime.artifact.Artifact) -> runtime.backend.Backend

which raises `runtime.errors.BackendUnavailable` saying why the backend cannot run this artifact here. Adding a
backend is that module and one row in BACKENDS (tests/runtime/test_backend_table.py adds a fake one).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator

AUTO = "auto"  # load()'s choice: the engine for the device, else the cpu variant on the backend the compile chose


@dataclass(frozen=True)
class BackendSpec:
    """A backend: `name` as tensorsmith spells it, `title` as people write it, `runs_engines` (the device's TensorRT
    engine; else the cpu variant) and `module`, which defines `open_backend(artifact)`."""

    name: str
    title: str
    runs_engines: bool
    module: str


TENSORRT = BackendSpec("tensorrt", "TensorRT", runs_engines=True, module="tensorsmith.runtime.tensorrt_backend")
ONNX_RUNTIME = BackendSpec(
    "onnxruntime", "ONNX Runtime", runs_engines=False, module="tensorsmith.runtime.onnxruntime_backend"
)
OPENVINO = BackendSpec("openvino", "OpenVINO", runs_engines=False, module="tensorsmith.runtime.openvino_backend")
# In load(backend="auto")'s order: the engine, then the cpu variant on the backend the compile recorded for it, else
# on the first cpu row (the default, which runs every variant the compiler writes).
BACKENDS: list[BackendSpec] = [TENSORRT, ONNX_RUNTIME, OPENVINO]


def backend_names() -> list[str]:
    return [spec.name for spec in BACKENDS]


def engine_backends() -> tuple[BackendSpec, ...]:
    """The rows that run an engine built for the device."""
    return tuple(spec for spec in BACKENDS if spec.runs_engines)


def cpu_backends() -> tuple[BackendSpec, ...]:
    """The rows that run the cpu target's variant, the default first."""
    return tuple(spec for spec in BACKENDS if not spec.runs_engines)


def backend_named(name: str) -> BackendSpec:
    """The row called `name`; ValueError (pydantic's and click's form) naming the close one and the choices."""
    for spec in BACKENDS:
        if spec.name == name:
            return spec
    close = difflib.get_close_matches(name, backend_names(), n=1, cutoff=0.6)
    guess = f"did you mean {close[0]}? " if close else ""
    raise ValueError(f"unknown backend {name!r} ({guess}backends are {', '.join(backend_names())})")


def _known_cpu_backend(name: str) -> str:
    if backend_named(name).runs_engines:
        raise ValueError(f"{name} runs engines, not the cpu variant (cpu backends: {[s.name for s in cpu_backends()]})")
    return name


# the manifest's record of what runs a cpu variant: a cpu row's name
CpuBackendName = Annotated[str, AfterValidator(_known_cpu_backend)]
