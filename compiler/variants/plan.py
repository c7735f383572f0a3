"""The variant plan: which recipe each target gets (the target table decides), and which targets share one."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.targets import Quantized, Recipe, get_target


@dataclass(frozen=True)
class VariantPlan:
    """target → recipe, in the config's target order."""

    request: str  # the `--precision` asked for
    by_target: dict[str, Recipe]
    notes: dict[str, str] = field(default_factory=dict)  # target → why it gets another recipe than asked (sm_75)

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
            if recipe.quantized == "int8" or recipe.quantized == "fp8":
                grouped.setdefault(recipe.quantized, {})[recipe] = targets
        return grouped

    def int4(self) -> dict[Recipe, list[str]]:
        """The INT4 weight-only recipes (no calibration of activations; AWQ's statistics at most)."""
        return {recipe: targets for recipe, targets in self.recipes().items() if recipe.quantized == "int4"}

    def without_int4(self) -> VariantPlan:
        """The targets whose recipes are float (those that cannot run INT4)."""
        kept = {target: recipe for target, recipe in self.by_target.items() if recipe.quantized != "int4"}
        return VariantPlan(self.request, kept, self.notes)


def plan_variants(config: CompileConfig, decoder: bool = False) -> VariantPlan:
    """A decoder's `auto` chooses weight precisions (int4 / int8 / float per layer, bytes being what decoding
    pays); any other model's chooses int8 or fp8 layers with calibrated activations."""
    targets = [get_target(name) for name in config.targets]
    notes = {target.name: note for target in targets if (note := target.fallback(config.precision, decoder))}
    recipes = {target.name: target.recipe(config.precision, decoder) for target in targets}
    return VariantPlan(config.precision, recipes, notes)
