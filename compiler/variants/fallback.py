"""When the cpu target runs the fp32 reference instead of its quantized variant: where the variant quantizes
nothing (every layer float and its weights as large as the reference's: the reference under another name), or
misses a budget that the reference meets (every variant is measured against the reference, so a lossless metric's
budget always holds for it). Quantizing nothing is then the answer the budget allows: the compile meets it, and no
file is named for a precision it does not hold.

Not for GPU targets (their float alternative, fp16 or bf16 regions, was not measured on the data), nor for a
reference measured a layer at a time (a large decoder's: shipping it would write its float32 weights whole)."""

from __future__ import annotations

from tensorsmith.compiler.variants.precision_plan import FloatInstead, PrecisionPlan
from tensorsmith.core.metrics import Budget
from tensorsmith.core.precisions import precision
from tensorsmith.runtime.manifest import VariantRecord

# A variant whose every layer is float counts as the reference when its weights are within this share of the
# reference's bytes (its graph's own bytes differ a little); a quantized vocabulary table saves far more.
SAME_SIZE = 0.01


def cpu_float_instead(
    cpu: VariantRecord,
    reference: VariantRecord,
    plan: PrecisionPlan,
    budget: Budget | None,
    variant_bytes: int,
    reference_bytes: int,
) -> FloatInstead | None:
    """The reference and why, where the cpu target should run it instead of `cpu`; else None. The bytes: of each
    file with its external data."""
    recipe = plan.recipes.get(cpu.name)
    if recipe is None or cpu.name == reference.name:  # not a recipe's own variant (a dynamic one meets its budget)
        return None
    as_large = variant_bytes >= reference_bytes * (1 - SAME_SIZE)
    if recipe.layers and all(precision(layer.precision).is_float for layer in recipe.layers) and as_large:
        return FloatInstead(variant=reference.name, reason=f"{cpu.name} quantized no layer and no table")
    if budget is not None and not recipe.met and budget.met_by_the_reference:
        achieved = f" ({recipe.achieved:.6g})" if recipe.achieved is not None else ""
        return FloatInstead(
            variant=reference.name,
            reason=f"{cpu.name} missed the budget {budget}{achieved}, which {reference.name} meets",
        )
    return None
