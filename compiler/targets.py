"""The target table (DESIGN.md "Targets and builders"): what each architecture runs, and who builds for it."""

from __future__ import annotations

from dataclasses import dataclass

from tensorsmith.compiler.errors import ConfigError


@dataclass(frozen=True)
class Target:
    name: str
    gpus: str
    precisions: tuple[str, ...]
    builders: tuple[str, ...]  # in order of preference; empty: runs on ONNX Runtime


AMPERE = ("fp32", "fp16", "bf16", "int8")
TARGETS = {
    target.name: target
    for target in (
        Target("cpu", "x86-64 / arm64", ("fp32", "int8"), ()),
        # TensorRT-RTX has no fp32 GEMM on Turing.
        Target("sm_75", "Turing", ("fp16", "int8"), ("tensorrt-rtx",)),
        Target("sm_80", "Ampere (A100)", AMPERE, ("tensorrt-rtx", "tensorrt")),
        Target("sm_86", "Ampere (RTX 30, A10)", AMPERE, ("tensorrt-rtx", "tensorrt")),
        Target("sm_87", "Ampere (Orin)", AMPERE, ("tensorrt",)),
        Target("sm_89", "Ada", (*AMPERE, "fp8"), ("tensorrt-rtx", "tensorrt")),
        Target("sm_90", "Hopper (H100, H200)", (*AMPERE, "fp8"), ("tensorrt",)),
        Target("sm_100", "Blackwell (B200)", (*AMPERE, "fp8"), ("tensorrt",)),
        Target("sm_120", "Blackwell (RTX 50)", (*AMPERE, "fp8"), ("tensorrt-rtx", "tensorrt")),
        Target("sm_121", "Blackwell (DGX Spark)", (*AMPERE, "fp8"), ("tensorrt-rtx", "tensorrt")),
    )
}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ConfigError(f"unknown target '{name}'", hint=f"targets are {', '.join(TARGETS)}") from None


def float_variant(precision: str, target: str) -> str:
    """The float variant a target runs for `--precision fp32|fp16`: fp16 where asked (GPUs) or where the
    architecture has no fp32 GEMM (sm_75), else fp32."""
    precisions = get_target(target).precisions
    if "fp16" in precisions and (precision == "fp16" or "fp32" not in precisions):
        return "fp16"
    return "fp32"


def quantized_precision(target: str) -> str:
    """The precision `auto` quantizes to on a target: fp8 where the architecture has it, else int8."""
    return "fp8" if "fp8" in get_target(target).precisions else "int8"


def check_precision(precision: str, target_names: list[str]) -> None:
    """Refuse, before any work starts, a precision that one of the targets cannot run."""
    if precision == "auto":
        return
    for name in target_names:
        target = get_target(name)
        runs = set(target.precisions) | ({"fp32"} if "fp16" in target.precisions else set())  # fp32 → fp16 variant
        if precision not in runs:
            newer = [t.name for t in TARGETS.values() if precision in t.precisions]
            raise ConfigError(
                f"target {name} ({target.gpus}) cannot run {precision}; it runs {', '.join(target.precisions)}",
                hint=f"{precision} needs one of {', '.join(newer)}" if newer else "choose another precision",
            )
