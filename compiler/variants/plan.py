"""The variant plan: which recipe each target gets (the target table decides), and which targets share one."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.targets import Recipe, get_target
from tensorsmith.core.precisions import Family, Precision, float_regions

CPU_TARGET = "cpu"


def family_of(recipe: Recipe) -> Family:
    """The builder family a recipe belongs to: its quantized precision's, or float."""
    return Family.FLOAT if recipe.quantized is None else recipe.quantized.family


@dataclass(frozen=True)
class VariantPlan:
    """target → recipe, in the config's target order."""

    request: str  # the `--precision` asked for
    by_target: dict[str, Recipe]
    notes: dict[str, str] = field(default_factory=dict)  # target → why it gets another recipe than asked (sm_75)
    # what a target takes that cannot run a weight-only request (a bf16 checkpoint's bf16)
    floats: Precision = field(default_factory=lambda: float_regions(on_gpu=True))

    @property
    def ships_reference(self) -> bool:
        """Whether the artifact must keep the fp32 reference graph: a target runs it. A large decoder's artifact
        leaves it out otherwise (compiler/pipeline.py: at 14B it is 59 GB); the runtime's fallback on a machine
        without the targets' GPUs is then the cpu target's variant, and a GPU-only artifact has none."""
        return any(recipe.quantized is None and recipe.floats.reference for recipe in self.by_target.values())

    def recipes(self) -> dict[Recipe, list[str]]:
        """Each recipe with the targets that share its variant, first-come order."""
        shared: dict[Recipe, list[str]] = {}
        for target, recipe in self.by_target.items():
            shared.setdefault(recipe, []).append(target)
        return shared

    def by_family(self) -> dict[Family, VariantPlan]:
        """The plan split by builder family, each part with only its targets (the float part always: it
        measures the fp32 reference)."""
        parts: dict[Family, dict[str, Recipe]] = {Family.FLOAT: {}}
        for target, recipe in self.by_target.items():
            parts.setdefault(family_of(recipe), {})[target] = recipe
        return {
            family: VariantPlan(self.request, recipes, self.notes, self.floats) for family, recipes in parts.items()
        }

    def by_precision(self) -> dict[Precision, dict[Recipe, list[str]]]:
        """The quantized recipes grouped by precision (one calibration and one search serve each precision)."""
        grouped: dict[Precision, dict[Recipe, list[str]]] = {}
        for recipe, targets in self.recipes().items():
            if recipe.quantized is not None:
                grouped.setdefault(recipe.quantized, {})[recipe] = targets
        return grouped


def plan_variants(config: CompileConfig, decoder: bool = False, floats: Precision | None = None) -> VariantPlan:
    """A decoder's `auto` chooses weight precisions (int4 / int8 / float per layer, bytes being what decoding
    pays); any other model's chooses int8 or fp8 layers with calibrated activations. `floats`: what a target that
    cannot run a weight-only request takes instead (Target.recipe)."""
    targets = [get_target(name) for name in config.targets]
    notes = {target.name: note for target in targets if (note := target.fallback(config.precision, decoder, floats))}
    recipes = {target.name: target.recipe(config.precision, decoder, floats) for target in targets}
    return VariantPlan(config.precision, recipes, notes, floats or float_regions(on_gpu=True))
