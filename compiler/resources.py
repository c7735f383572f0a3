"""Will the compile fit? Memory and disk estimated from the checkpoint's headers and the variant plan, before any
work, so that a model too large for the machine is refused in one line with the figures, never killed by the
kernel an hour in.

The estimate follows what the compile holds today, measured at the 135M, 1B and 3B shapes (docs/benchmarks.md):
the fused graph is float32 on disk, the sessions that measure it hold its narrow twin (16-bit weights), and each
variant is written and measured next to it. So the peak grows with the parameter count times four bytes:
`MEMORY_PER_FP32_BYTE` of it for the heaviest variant the plan writes, beside `BASE_MEMORY` for torch,
transformers, ONNX Runtime and the sessions' working memory. Disk holds the float32 graph, its twin, every variant
and every engine at once (the artifact is written next to its final place, then renamed; a reference no target
runs is removed only at the end).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.compiler.targets import Recipe
from tensorsmith.compiler.variants.plan import VariantPlan
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.memory import available_memory
from tensorsmith.core.precisions import Family

GB = 10**9
BASE_MEMORY = int(1.5 * GB)
# peak resident bytes per byte of the float32 weights, by what the heaviest variant does, from the compiles measured
# since the export reads no float32 module (docs/benchmarks.md): weight-only 1.0 (1B INT4 AWQ's variant step, 0.97;
# 3B INT4 RTN for sm_86 alone: 0.46), float 0.75 (1B fp16 for cpu + sm_86: 0.64), calibrated 1.0 (not measured at
# scale: as weight-only), 2.0 for an fp32 variant measured whole and a decoder's weight search (its stacked levels)
MEMORY_PER_FP32_BYTE = {Family.WEIGHT_ONLY: 1.0, Family.CALIBRATED: 1.0, Family.FLOAT: 0.75}
FP32_OR_SEARCH = 2.0
TWIN_ABOVE = 1 << 30  # bytes the narrow twin saves at least, or it is not written (core/narrow_twin.py)
QUANTIZED_OVERHEAD = 1.25  # a quantized variant's scales and the layers it keeps in float


@dataclass(frozen=True)
class ResourceEstimate:
    parameters: int  # float weights in the checkpoint
    memory: int  # peak resident bytes, estimated
    disk: int  # bytes written under the output's parent, estimated
    available_memory: int | None  # None where this system does not say (the memory is then not checked)
    free_disk: int
    disk_path: Path

    @property
    def memory_short(self) -> bool:
        return self.available_memory is not None and self.memory > self.available_memory

    @property
    def fits(self) -> bool:
        return not self.memory_short and self.disk <= self.free_disk

    def largest_fitting(self) -> int:
        """Parameters that the cheapest plan (INT4, one target) fits in this machine's memory."""
        available = self.available_memory or 0
        return max(0, int((available - BASE_MEMORY) / (4 * MEMORY_PER_FP32_BYTE[Family.WEIGHT_ONLY])))


def _memory_factor(recipe: Recipe, request_is_search: bool) -> float:
    if request_is_search or (recipe.quantized is None and recipe.floats.element.bits == 32):
        return FP32_OR_SEARCH
    family = recipe.quantized.family if recipe.quantized is not None else Family.FLOAT
    return MEMORY_PER_FP32_BYTE[family]


def _variant_bytes(recipe: Recipe, parameters: int) -> int:
    if recipe.quantized is None:
        return parameters * recipe.floats.element.bits // 8
    return int(parameters * recipe.quantized.element.bits / 8 * QUANTIZED_OVERHEAD)


def estimate(directory: Path, plan: VariantPlan, out: Path, search: bool, streamed: bool = True) -> ResourceEstimate:
    """What compiling the checkpoint in `directory` into `out` by `plan` holds at its peak, and writes. `search`:
    a decoder's `auto`, whose weight search holds every level of a layer at once; `streamed`: the export reads the
    weights from the checkpoint (a stamped decoder), else it loads the float32 module whole beside the rest."""
    parameters = CheckpointWeights(directory).float_parameters()
    fp32 = 4 * parameters
    recipes = plan.recipes()
    factor = max((_memory_factor(recipe, search) for recipe in recipes), default=FP32_OR_SEARCH)
    memory = BASE_MEMORY + int(fp32 * factor) + (0 if streamed else fp32)
    twin = fp32 // 2 if fp32 // 2 >= TWIN_ABOVE else 0
    variants = sum(_variant_bytes(recipe, parameters) for recipe in recipes if recipe.quantized or
                   recipe.floats.element.bits < 32)  # fmt: skip
    engines = sum(_variant_bytes(recipe, parameters) for recipe, targets in recipes.items()
                  for target in targets if not recipe.on_cpu)  # fmt: skip
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    return ResourceEstimate(parameters, memory, fp32 + twin + variants + engines, available_memory(),
                            free_disk(parent), parent)  # fmt: skip


def free_disk(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_resources(
    directory: Path, plan: VariantPlan, out: Path, search: bool, streamed: bool = True
) -> ResourceEstimate:
    """The estimate, or a ConfigError saying what the compile needs, what the machine has and what would fit."""
    found = estimate(directory, plan, out, search, streamed)
    if found.fits:
        return found
    targets = ", ".join(plan.by_target)
    short = []
    if found.memory_short:
        short.append(f"{found.memory / GB:.1f} GB of memory (this machine has {(found.available_memory or 0) / GB:.1f} "
                     "GB available)")  # fmt: skip
    if found.disk > found.free_disk:
        short.append(f"{found.disk / GB:.0f} GB of disk ({found.free_disk / GB:.0f} GB free on {found.disk_path})")
    memory_hint = (f"this machine's memory holds decoders up to about {found.largest_fitting() / 1e9:.1f}B parameters "
                   "(--precision int4); " if found.memory_short else "")  # fmt: skip
    raise ConfigError(
        f"{directory}: compiling {found.parameters / 1e9:.2f}B parameters ({plan.request} for {targets}) needs about "
        f"{' and '.join(short)}",
        hint=f"{memory_hint}fewer targets and int4 cut the disk needed; --no-resource-check tries anyway",
    )
