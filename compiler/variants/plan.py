"""The variant plan: which recipe each target gets (the target table decides), and which targets share one."""

from __future__ import annotations

from dataclasses import dataclass

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.targets import Quantized, Recipe, get_target


@dataclass(frozen=True)
class VariantPlan:
    """target → recipe, in the config's target order."""

    request: str  # the `--precision` asked for
    by_target: dict[str, Recipe]

    def recipes(self) -> dict[Recipe, list[str]]:
        """Each recipe with the targets that share its variant, first-come order."""
        shared: dict[Recipe, list[str]] = {}
        for target, recipe in self.by_target.items():
            shared.setdefault(recipe, []).append(target)
        return shared

    def quantized(self) -> dict[Quantized, dict[Recipe, list[str]]]:
        """The quantized recipes grouped by precision (one calibration and one search serve each precision)."""
        grouped: dict[Quantized, dict[Recipe, list[str]]] = {}
        for recipe, targets in self.recipes().items():
            if recipe.quantized is not None:
                grouped.setdefault(recipe.quantized, {})[recipe] = targets
        return grouped


def plan_variants(config: CompileConfig) -> VariantPlan:
    return VariantPlan(config.precision, {name: get_target(name).recipe(config.precision) for name in config.targets})
