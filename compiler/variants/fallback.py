"""When the cpu target runs the fp32 reference instead of its quantized variant: where the variant quantizes no
layer (it is the reference under another name), or misses a budget that the reference meets (every variant is
measured against the reference, so a lossless metric's budget always holds for it). Quantizing nothing is then the
answer the budget allows: the compile meets it, and no file is named for a precision it does not hold.

GPU targets keep their variant: their float alternative (fp16 or bf16 regions) was not measured on the data."""

from __future__ import annotations

from tensorsmith.compiler.variants.plan import CPU_TARGET
from tensorsmith.compiler.variants.precision_plan import FloatInstead, PrecisionPlan
from tensorsmith.core.metrics import Budget
from tensorsmith.core.precisions import precision
from tensorsmith.runtime.manifest import VariantRecord


def cpu_float_instead(
    by_target: dict[str, VariantRecord], reference: VariantRecord, plan: PrecisionPlan, budget: Budget | None
) -> FloatInstead | None:
    """The reference and why, where the cpu target should run it instead of its quantized variant; else None."""
    cpu = by_target.get(CPU_TARGET)
    recipe = plan.recipes.get(cpu.name) if cpu is not None else None
    if cpu is None or recipe is None or cpu.name == reference.name:
        return None
    if recipe.layers and all(precision(layer.precision).is_float for layer in recipe.layers):
        return FloatInstead(variant=reference.name, reason=f"{cpu.name} quantized no layer")
    if budget is not None and not recipe.met and budget.met_by_the_reference:
        achieved = f" ({recipe.achieved:.6g})" if recipe.achieved is not None else ""
        return FloatInstead(
            variant=reference.name,
            reason=f"{cpu.name} missed the budget {budget}{achieved}, which {reference.name} meets",
        )
    return None
