"""Will the compile fit? Memory and disk estimated from the checkpoint's headers and the variant plan, before any
work, so that a model too large for the machine is refused in one line with the figures, never killed by the
kernel an hour in.

A decoder whose export streams its weights (no float32 module: frontend/stamped_export.py) is measured a layer at a
time where its graphs are large (core/layerwise.py), and its INT4 codes are written a block of rows at a time: its
compile holds the largest weights a stage reads at once, not the model. Measured at the 1B and 8B shapes
(docs/benchmarks.md), its peak is the largest of
- the export and the layerwise runs: `BASE_MEMORY` + `PER_LARGEST_FP32_BYTE` x the largest weight's float32 bytes
  (the vocabulary tables, read whole) + one segment;
- each engine build, in its own process: `ENGINE_BASE` + `ENGINE_PER_VARIANT_BYTE` x the variant it builds from
  (TensorRT for RTX's parser holds the weights, the builder its engine's copy);
- a decoder's `auto`, whose weight search holds every level of a layer at once: `FP32_OR_SEARCH` x the float32
  weights.
Every other source loads its float32 module whole, and its sessions hold the graph: the float32 weights' bytes times
what the heaviest variant holds (`MEMORY_PER_FP32_BYTE`). Disk holds the float32 graph, its narrow twin where one is
written, every variant and every engine at once (the artifact is written next to its final place, then renamed; a
reference no target runs is removed only at the end).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tensorsmith.compiler.frontend.quantized_checkpoint import checkpoint_weights
from tensorsmith.compiler.targets import Recipe
from tensorsmith.compiler.variants.plan import VariantPlan
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.layerwise import LAYERWISE_SEGMENT_BYTES, LAYERWISE_SHARE
from tensorsmith.core.memory import available_memory
from tensorsmith.core.precisions import Family

GB = 10**9
BASE_MEMORY = int(1.5 * GB)
# peak resident bytes per byte of the float32 weights, by what the heaviest variant does, from the compiles
# measured since the export reads no float32 module (docs/benchmark-history.md): weight-only 1.0 (1B INT4 AWQ's
# variant step, 0.97; 3B INT4 RTN for sm_86 alone: 0.46), float 0.75 (1B fp16 for cpu + sm_86: 0.64), calibrated
# 1.0 (not measured at scale: as weight-only), 2.0 for an fp32 variant measured whole and a decoder's weight
# search (its stacked levels)
MEMORY_PER_FP32_BYTE = {Family.WEIGHT_ONLY: 1.0, Family.FP8_WEIGHTS: 1.0, Family.CALIBRATED: 1.0, Family.FLOAT: 0.75}
FP32_OR_SEARCH = 2.0
TWIN_ABOVE = 1 << 30  # bytes the narrow twin saves at least, or it is not written (core/narrow_twin.py)
QUANTIZED_OVERHEAD = 1.25  # a quantized variant's scales and the layers it keeps in float
REWRITTEN_SHARE = 1 / 8  # of a graph that refers to its checkpoint, the fp32 weights it writes itself
# a streamed decoder (the module's docstring), from the 8B INT4 compile for cpu + sm_86: export 5.76 GB and the int4
# variant's step 6.38 GB with 2.1 GB tables (1.5 + 2.0 x 2.1 + a 0.5 GB segment = 6.2), its sm_86 build 9.6 GB from a
# 4.2 GB variant (estimated 5.0 GB: 0.7 + 1.8 x 5.0 = 9.7)
PER_LARGEST_FP32_BYTE = 2.0
# a module loaded whole and compiled to fp32 variants only, peak bytes per fp32 byte: measured 1.47 (DeepSeek-V2-
# Lite's first 4 layers, its experts written once: 14.7 GB for 9.0), 1.6 (its first 2 layers)
WHOLE_FP32_ONLY = 2.0
ENGINE_BASE = int(0.7 * GB)
ENGINE_PER_VARIANT_BYTE = 1.8


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
        """Parameters whose INT4 engine (a streamed decoder's largest stage) this machine's memory builds."""
        available = self.available_memory or 0
        return max(0, int((available - ENGINE_BASE) / (ENGINE_PER_VARIANT_BYTE * 0.5 * QUANTIZED_OVERHEAD)))


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
    weights = checkpoint_weights(directory)  # a pre-quantized checkpoint's INT4 weights counted as float weights
    parameters = weights.float_parameters()
    fp32 = 4 * parameters
    recipes = plan.recipes()
    available = available_memory()
    if streamed:
        engines_from = [_variant_bytes(recipe, parameters) for recipe in recipes if not recipe.on_cpu]
        memory = max(
            BASE_MEMORY + int(PER_LARGEST_FP32_BYTE * 4 * weights.largest_float()) + LAYERWISE_SEGMENT_BYTES,
            ENGINE_BASE + int(ENGINE_PER_VARIANT_BYTE * max(engines_from, default=0)),
            BASE_MEMORY + int(FP32_OR_SEARCH * fp32) if search else 0,
        )
    elif recipes and not search and all(_memory_factor(recipe, False) == FP32_OR_SEARCH for recipe in recipes):
        memory = BASE_MEMORY + int(WHOLE_FP32_ONLY * fp32)  # its fp32 graph is the variant: no second copy
    else:
        factor = max((_memory_factor(recipe, search) for recipe in recipes), default=FP32_OR_SEARCH)
        memory = BASE_MEMORY + int(fp32 * factor) + fp32
    layerwise = available is not None and fp32 > available * LAYERWISE_SHARE  # then no twin is written
    twin = fp32 // 2 if fp32 // 2 >= TWIN_ABOVE and not layerwise else 0
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    # run a layer at a time, a streamed decoder's graph refers to the checkpoint's files (core/checkpoint_references):
    # it writes only the weights its passes change (the attention-scaled queries: 8% of a Llama's parameters)
    if streamed and layerwise and directory.stat().st_dev == parent.stat().st_dev:
        fp32 = int(fp32 * REWRITTEN_SHARE)
    variants = sum(
        _variant_bytes(recipe, parameters) for recipe in recipes if recipe.quantized or recipe.floats.element.bits < 32
    )
    engines = sum(
        _variant_bytes(recipe, parameters)
        for recipe, targets in recipes.items()
        for target in targets
        if not recipe.on_cpu
    )
    return ResourceEstimate(parameters, memory, fp32 + twin + variants + engines, available, free_disk(parent), parent)


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
        short.append(
            f"{found.memory / GB:.1f} GB of memory (this machine has {(found.available_memory or 0) / GB:.1f} "
            "GB available)"
        )
    if found.disk > found.free_disk:
        short.append(f"{found.disk / GB:.0f} GB of disk ({found.free_disk / GB:.0f} GB free on {found.disk_path})")
    if not found.memory_short:
        memory_hint = ""
    elif streamed:
        memory_hint = (
            f"this machine's memory holds decoders up to about {found.largest_fitting() / 1e9:.1f}B parameters "
            "(--precision int4); "
        )
    else:  # the whole float32 module, whatever the precision
        memory_hint = "its weights are loaded whole as float32, not read from the checkpoint tensor by tensor; "
    raise ConfigError(
        f"{directory}: compiling {found.parameters / 1e9:.2f}B parameters ({plan.request} for {targets}) needs about "
        f"{' and '.join(short)}",
        hint=f"{memory_hint}fewer targets and int4 cut the disk needed; --no-resource-check tries anyway",
    )
