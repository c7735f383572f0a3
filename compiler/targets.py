"""The target table (DESIGN.md "Targets and builders"): one row per architecture, and the only place that says
what a target runs, which variant recipe it gets for each `--precision`, who builds its engine, and how large
its default batch is. `compile`, `tensorsmith build` and `export-triton` all ask it.

Adding a target is one row here (and its tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tensorsmith.core.errors import ConfigError

Builder = Literal["tensorrt-rtx", "tensorrt"]
Request = Literal["fp32", "fp16", "int8", "fp8", "int4", "auto"]  # what `--precision` asks for
Quantized = Literal["int8", "fp8"]  # activations and weights, calibrated
WeightOnly = Literal["int4"]  # weights only (blockwise DequantizeLinear)
Floats = Literal["fp32", "fp16"]

# INT4 weight-only: TensorRT for RTX builds it for sm_86, sm_89 and sm_120, not sm_75 (checked: a 256×128 block-128
# INT4 MatMul), data-centre TensorRT from Ampere on; ONNX Runtime's CPU provider fuses it into MatMulNBits.
AMPERE = ("fp32", "fp16", "bf16", "int8", "int4")


@dataclass(frozen=True)
class Recipe:
    """How one variant is made: layers quantized to `quantized` (None: none), everything else computed in
    `floats`. Targets whose recipes are equal share one variant file (and an engine input)."""

    quantized: Quantized | WeightOnly | None
    floats: Floats

    @property
    def variant(self) -> str:
        """The variant's name: fp32/fp16 for float variants; int8/fp8 for GPU ones (fp16 regions); cpu-int8 for
        the cpu's (fp32 regions)."""
        if self.quantized is None:
            return self.floats
        return self.quantized if self.floats == "fp16" else f"cpu-{self.quantized}"


@dataclass(frozen=True)
class Target:
    name: str
    gpus: str
    precisions: tuple[str, ...]
    rtx_capability: str | None = None  # TensorRT for RTX's ComputeCapability member; None: it cannot build for it
    datacenter: bool = False  # data-centre TensorRT builds for it, on a GPU of this architecture
    max_batch: int = 64  # the profile's max for a dim named `batch` that the config gives no max
    float_regions: Floats = "fp16"  # what a quantized variant computes its unquantized layers in

    @property
    def builders(self) -> tuple[Builder, ...]:
        """Who can build its engine, in order of preference; empty: it runs the variant on ONNX Runtime."""
        rtx: tuple[Builder, ...] = ("tensorrt-rtx",) if self.rtx_capability else ()
        return (*rtx, "tensorrt") if self.datacenter else rtx

    @property
    def on_device_builder(self) -> Builder:
        """The builder a pending engine waits for, on a machine with this GPU."""
        return "tensorrt" if self.datacenter else self.builders[0]

    def fallback(self, request: Request, weight_only: bool = False) -> str | None:
        """Why this target gets another variant than `request` asks for, where it does (the manifest says it)."""
        if (request == "int4" or (request == "auto" and weight_only)) and "int4" not in self.precisions:
            return f"{self.name} ({self.gpus}) has no INT4 weight-only kernels: {self.recipe('int4').variant} instead"
        return None

    def runs(self, precision: str) -> bool:
        """Whether a `--precision` request can be served (fp32 on a target without fp32 GEMM gets fp16)."""
        return (
            precision == "auto" or precision in self.precisions or (precision == "fp32" and "fp16" in self.precisions)
        )

    def recipe(self, request: Request, weight_only: bool = False) -> Recipe:
        """The variant this target runs for `--precision request`. `weight_only`: a decoder's `auto`, which chooses
        each weight layer's precision (int4, int8 weight-only, float): an INT4-recipe variant, like `int4`."""
        if request == "int8" or request == "fp8":
            return Recipe(request, self.float_regions)
        if request == "int4" or (request == "auto" and weight_only):
            if "int4" in self.precisions:
                return Recipe("int4", self.float_regions)
            return self.recipe("fp16")  # the best it runs (sm_75): `fallback` says why
        if request == "auto":
            return Recipe("fp8" if "fp8" in self.precisions else "int8", self.float_regions)
        half = "fp16" in self.precisions and (request == "fp16" or "fp32" not in self.precisions)
        return Recipe(None, "fp16" if half else "fp32")


TARGETS = {
    target.name: target
    for target in (
        Target("cpu", "x86-64 / arm64", ("fp32", "int8", "int4"), float_regions="fp32"),
        # TensorRT-RTX has no fp32 GEMM on Turing.
        Target("sm_75", "Turing", ("fp16", "int8"), rtx_capability="SM75", datacenter=True, max_batch=32),
        Target("sm_80", "Ampere (A100)", AMPERE, rtx_capability="SM80", datacenter=True, max_batch=128),
        Target("sm_86", "Ampere (RTX 30, A10)", AMPERE, rtx_capability="SM86", datacenter=True),
        Target("sm_87", "Ampere (Orin)", AMPERE, datacenter=True),
        Target("sm_89", "Ada", (*AMPERE, "fp8"), rtx_capability="SM89", datacenter=True),
        Target("sm_90", "Hopper (H100, H200)", (*AMPERE, "fp8"), datacenter=True, max_batch=256),
        Target("sm_100", "Blackwell (B200)", (*AMPERE, "fp8"), datacenter=True, max_batch=256),
        Target("sm_120", "Blackwell (RTX 50)", (*AMPERE, "fp8"), rtx_capability="SM120", datacenter=True),
        Target("sm_121", "Blackwell (DGX Spark)", (*AMPERE, "fp8"), rtx_capability="SM121", datacenter=True),
    )
}
RTX_TARGETS = tuple(name for name, target in TARGETS.items() if target.rtx_capability)


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ConfigError(f"unknown target '{name}'", hint=f"targets are {', '.join(TARGETS)}") from None


def check_precision(precision: str, target_names: list[str]) -> None:
    """Refuse, before any work starts, a precision that one of the targets cannot run. fp16 is a request for the
    GPU targets: the cpu target keeps fp32 beside them (refused only when no target runs fp16)."""
    if precision in ("fp16", "int4") and any(get_target(name).runs(precision) for name in target_names):
        return  # the others get the best they run (`Target.recipe`)
    for name in target_names:
        target = get_target(name)
        if not target.runs(precision):
            newer = [t.name for t in TARGETS.values() if precision in t.precisions]
            raise ConfigError(
                f"target {name} ({target.gpus}) cannot run {precision}; it runs {', '.join(target.precisions)}",
                hint=f"{precision} needs one of {', '.join(newer)}" if newer else "choose another precision",
            )
