"""The target table (DESIGN.md "Targets and builders"): one row per architecture, and the only place that says
what a target is, which variant recipe it gets for each `--precision`, who builds its engine, and how large its
default batch is. What a target runs comes from the precision table (core/precisions.py): a row names its
compute capability (or none: the cpu) and its backend. `compile`, `tensorsmith build` and `export-triton` all
ask it.

Adding a target is one row here (and its tests).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

from tensorsmith.core.elements import Element
from tensorsmith.core.errors import ConfigError, UsageError
from tensorsmith.core.precisions import (
    AUTO,
    PRECISIONS,
    Family,
    Precision,
    calibrated_for_auto,
    float_regions,
    float_served,
    precision,
    weight_only_request,
)
from tensorsmith.runtime.backends import ONNX_RUNTIME, TENSORRT, BackendSpec

Builder = Literal["tensorrt-rtx", "tensorrt"]
Request = str  # what `--precision` asks for: a requestable name of the precision table, or auto


@dataclass(frozen=True)
class Recipe:
    """How one variant is made: layers quantized to `quantized` (None: none), everything else computed in
    `floats`, run by `backend`. Targets whose recipes are equal share one variant file (and an engine input)."""

    quantized: Precision | None
    floats: Precision
    backend: BackendSpec = TENSORRT

    @property
    def on_cpu(self) -> bool:
        """Whether the cpu target's backends run it (ONNX Runtime or OpenVINO), not a TensorRT engine."""
        return not self.backend.runs_engines

    @property
    def fp16_regions(self) -> bool:
        """Whether its float regions are fp16 (ConvertToFp16 writes them; bf16 regions have their own pass)."""
        return self.floats.element is Element.FP16

    @property
    def variant(self) -> str:
        """The variant's name: the float precision for float variants; the quantized one for a GPU's (fp16
        regions), `cpu-` before it for the cpu's (fp32 regions), `-bf16` after it for bf16 regions."""
        if self.quantized is None:
            return self.floats.name
        if self.on_cpu:
            return f"cpu-{self.quantized.name}"
        gpu_regions = self.floats is float_regions(on_gpu=True)
        return self.quantized.name if gpu_regions else f"{self.quantized.name}-{self.floats.name}"


@dataclass(frozen=True)
class Target:
    name: str
    gpus: str
    capability: int | None  # compute capability × 10; None: the cpu target
    rtx_capability: str | None = None  # TensorRT for RTX's ComputeCapability member; None: it cannot build for it
    datacenter: bool = False  # data-centre TensorRT builds for it, on a GPU of this architecture
    max_batch: int = 64  # the profile's max for a dim named `batch` that the config gives no max

    @property
    def backend(self) -> BackendSpec:
        """What runs its variant by default: TensorRT on a GPU, ONNX Runtime on the cpu (the compile may measure
        OpenVINO faster and record that instead)."""
        return TENSORRT if self.capability is not None else ONNX_RUNTIME

    @property
    def float_regions(self) -> Precision:
        """What a quantized variant computes its unquantized layers in."""
        return float_regions(on_gpu=self.capability is not None)

    @property
    def precisions(self) -> tuple[str, ...]:
        """The names of the precisions it runs, in the table's order."""
        return tuple(name for name, record in PRECISIONS.items() if record.runs_on(self.capability))

    def runs_precision(self, record: Precision) -> bool:
        return record.runs_on(self.capability)

    @property
    def builders(self) -> tuple[Builder, ...]:
        """Who can build its engine, in order of preference; empty: it runs the variant on a cpu backend."""
        rtx: tuple[Builder, ...] = ("tensorrt-rtx",) if self.rtx_capability else ()
        return (*rtx, "tensorrt") if self.datacenter else rtx

    @property
    def on_device_builder(self) -> Builder:
        """The builder a pending engine waits for, on a machine with this GPU."""
        return "tensorrt" if self.datacenter else self.builders[0]

    def fallback(self, request: Request, weight_only: bool = False, floats: Precision | None = None) -> str | None:
        """Why this target gets another variant than `request` asks for, where it does (the manifest says it)."""
        wanted = weight_only_request(request, weight_only)
        if wanted is None and request != AUTO and self.capability is not None and precision(request).is_float:
            wanted = precision(request)  # a float request a GPU does not run (bf16 on sm_75)
        if wanted is not None and not self.runs_precision(wanted):
            instead = self.recipe(request, weight_only, floats).variant
            return f"{self.name} ({self.gpus}) has no {wanted.name} kernels: {instead} instead"
        return None

    def runs(self, request: Request) -> bool:
        """Whether a `--precision` request can be served (fp32 on a target without fp32 GEMM gets fp16)."""
        if request == AUTO:
            return True
        record = precision(request)
        return self.runs_precision(record) or record.reference

    def recipe(self, request: Request, weight_only: bool = False, floats: Precision | None = None) -> Recipe:
        """The variant this target runs for `--precision request`. `weight_only`: a decoder's `auto`, which chooses
        each weight layer's precision (int4, int8 weight-only, float): an INT4-recipe variant, like `int4`.
        `floats`: the float type it takes instead of a weight-only precision it cannot run (a bf16 checkpoint's
        bf16 where it runs bf16: what it would get alone; fp16 by default)."""
        wanted = weight_only_request(request, weight_only)
        regions = self.float_regions
        if wanted is not None:
            if self.runs_precision(wanted):
                return Recipe(wanted, regions, self.backend)
            fallback = floats or float_regions(on_gpu=True)
            return self.recipe(fallback.name)  # the best it runs (sm_75, or nvfp4 before Blackwell): `fallback` says
        if request == AUTO:
            return Recipe(calibrated_for_auto(self.capability), regions, self.backend)
        record = precision(request)
        if record.family is Family.CALIBRATED:
            return Recipe(record, regions, self.backend)
        return Recipe(None, float_served(record, self.capability), self.backend)


TARGETS = {
    target.name: target
    for target in (
        Target("cpu", "x86-64 / arm64", None),
        # TensorRT-RTX has no fp32 GEMM on Turing.
        Target("sm_75", "Turing", 75, rtx_capability="SM75", datacenter=True, max_batch=32),
        Target("sm_80", "Ampere (A100)", 80, rtx_capability="SM80", datacenter=True, max_batch=128),
        Target("sm_86", "Ampere (RTX 30, A10)", 86, rtx_capability="SM86", datacenter=True),
        Target("sm_87", "Ampere (Orin)", 87, datacenter=True),
        Target("sm_89", "Ada", 89, rtx_capability="SM89", datacenter=True),
        Target("sm_90", "Hopper (H100, H200)", 90, datacenter=True, max_batch=256),
        Target("sm_100", "Blackwell (B200)", 100, datacenter=True, max_batch=256),
        Target("sm_120", "Blackwell (RTX 50)", 120, rtx_capability="SM120", datacenter=True),
        Target("sm_121", "Blackwell (DGX Spark)", 121, rtx_capability="SM121", datacenter=True),
    )
}
RTX_TARGETS = tuple(name for name, target in TARGETS.items() if target.rtx_capability)


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise unknown_targets([name]) from None


def unknown_targets(names: list[str]) -> UsageError:
    """The error for target names the table lacks, with the closest known name where one is close (sm86 → sm_86)."""
    close = [match for name in names for match in difflib.get_close_matches(name, TARGETS, n=1, cutoff=0.8)]
    known = f"targets are {', '.join(TARGETS)}"
    said = f"unknown target '{names[0]}'" if len(names) == 1 else f"unknown targets {', '.join(map(repr, names))}"
    return UsageError(said, hint=f"did you mean {', '.join(close)}? {known}" if close else known)


def check_precision(request: Request, target_names: list[str]) -> None:
    """Refuse, before any work starts, a precision that one of the targets cannot run. A float or weight-only
    request is one for the targets that run it: the others get the best they run (`Target.recipe`), and it is
    refused only when no target runs it."""
    if request != AUTO:
        record = precision(request)
        if record.family is not Family.CALIBRATED and any(get_target(name).runs(request) for name in target_names):
            return
    for name in target_names:
        target = get_target(name)
        if not target.runs(request):
            newer = [t.name for t in TARGETS.values() if request in t.precisions]
            raise ConfigError(
                f"target {name} ({target.gpus}) cannot run {request}; it runs {', '.join(target.precisions)}",
                hint=f"{request} needs one of {', '.join(newer)}" if newer else "choose another precision",
            )
