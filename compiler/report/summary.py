"""An artifact's records as sentences for people: what `compile` and `inspect` print (`--json` prints the records
themselves), and the report's account of its source."""

from __future__ import annotations

from tensorsmith.compiler.frontend.export_cache import FROM_EXPORT_CACHE
from tensorsmith.compiler.variants.precision_plan import SEARCHED, LayerChoice, PrecisionPlan, RecipePlan
from tensorsmith.core.precisions import Quantizes, precision
from tensorsmith.passes import SkippedDetails
from tensorsmith.passes.cache_graph import StaticCacheDetails
from tensorsmith.passes.canonicalize import CanonicalizeDetails
from tensorsmith.passes.fusion import FusionDetails
from tensorsmith.runtime.manifest import Manifest, PassRecord, SourceRecord, TargetRecord, VariantRecord

SOURCE_KINDS = {
    "onnx": "an ONNX file",
    "huggingface": "a Hugging Face directory",
    "factory": "a PyTorch module",
    "exported_program": "a torch.export program",
}
EXPORTERS = {"dynamo": "torch.onnx's dynamo exporter", "torchscript": "torch.onnx's TorchScript exporter"}
# a fusion rule → (one, several), as the summary counts them
RULES = {
    "layernorm": ("LayerNorm", "LayerNorms"),
    "rmsnorm": ("RMSNorm", "RMSNorms"),
    "gelu_erf": ("GELU (erf)", "GELUs (erf)"),
    "gelu_tanh": ("GELU (tanh)", "GELUs (tanh)"),
    "attention_scale": ("attention scale", "attention scales"),
    "attention": ("attention block", "attention blocks"),
}
FUSED = {"attention_scale": "folded into the Q projection"}  # what a rule did, where it is not "fused"
METRICS = {
    "cosine": "cosine {:.6g}",
    "min-cosine": "min cosine {:.6g}",
    "sqnr-db": "SQNR {:.4g} dB",
    "max_relative_error": "max relative error {:.4g}",
    "perplexity-ratio": "perplexity ratio {:.6g}",  # as many digits as a budget on it
    "next-token-agreement": "next-token agreement {:.6g}",
}
NAMED = 3  # float layers named per reason; the rest counted


def source_sentence(source: SourceRecord, compiled_opset: int | None = None) -> str:
    """e.g. 'an ONNX file at opset 17, compiled at opset 20'."""
    text = SOURCE_KINDS.get(source.kind, source.kind)
    if source.weights:
        text += f" ({source.weights} weights)"
    if source.exporter in EXPORTERS:
        text += f", exported by {EXPORTERS[source.exporter]}"
        if source.fallback_reason:
            text += f" (the dynamo exporter failed: {source.fallback_reason})"
    text += f" at opset {source.opset}"
    if compiled_opset is not None and compiled_opset != source.opset:
        text += f", compiled at opset {compiled_opset}"
    return text


def _count_phrase(key: str, value: int) -> str:
    """A pass's count as words: tables_quantized 2 → '2 tables quantized', 1 → '1 table quantized'."""
    first, *rest = key.split("_")
    return " ".join([str(value), first.removesuffix("s") if value == 1 else first, *rest])


def _counted(count: int, rule: str) -> str:
    one, several = RULES.get(rule, (rule, rule))
    return f"{count} {one if count == 1 else several}"


def _fusion(record: PassRecord) -> str:
    """What each rule of a fusion pass did, from its RULE.matched / .missed / .already_fused / .skipped_opset
    counts; rules that found nothing are left out."""
    details = FusionDetails.read(record.details)
    needs_opset, reasons = (details.needs_opset, details.reasons) if details is not None else ({}, {})
    rules = list(dict.fromkeys(key.rsplit(".", 1)[0] for key in record.counts))
    clauses = []
    for rule in rules:
        matched = record.counts.get(f"{rule}.matched", 0)
        already = record.counts.get(f"{rule}.already_fused", 0)
        missed = record.counts.get(f"{rule}.missed", 0)
        if record.counts.get(f"{rule}.skipped_opset"):
            opset = needs_opset.get(rule)
            clauses.append(f"{RULES.get(rule, (rule, rule))[1]} not tried" + (f" below opset {opset}" if opset else ""))
        if matched:
            clauses.append(f"{_counted(matched, rule)} {FUSED.get(rule, 'fused')}")
        if already:
            clauses.append(f"{_counted(already, rule)} written by the exporter already")
        if missed:
            why = reasons.get(rule)
            first = f" (most often: {next(iter(why))})" if why else ""
            clauses.append(f"{_counted(missed, rule)} not fused{first}")
    return "; ".join(clauses) or "found no " + " and no ".join(RULES.get(rule, (rule, rule))[1] for rule in rules)


def _canonicalize(record: PassRecord) -> str:
    before, after = record.counts.get("nodes_before", 0), record.counts.get("nodes_after", 0)
    text = f"{before} nodes, {after} after folding constants" if before != after else f"{after} nodes, none folded"
    details = CanonicalizeDetails.read(record.details)
    changed = details is not None and details.opset_before != details.opset_after
    return text + (f"; opset {details.opset_before} → {details.opset_after}" if details and changed else "")


def pass_sentence(record: PassRecord) -> str:
    """e.g. 'weight_only_int4, for variant int4: 12 matmuls quantized, 0 skipped (0.31 s)'."""
    title = record.name + (f", for variant {record.variant}" if record.variant else "")
    skipped = SkippedDetails.read(record.details) if record.counts == {"skipped": 1} else None
    cache = StaticCacheDetails.read(record.details) if record.name == "static_kv_cache" else None
    if skipped is not None:
        text = f"skipped: {skipped.reason}"
    elif record.name == "canonicalize":
        text = _canonicalize(record)
    elif cache is not None:
        length = f"{cache.capacity} slots" if isinstance(cache.capacity, int) else "the request's length"
        text = f"{record.counts.get('layers', 0)} layers, {cache.cache_dtype} caches of {length}"
    elif any(key.rsplit(".", 1)[-1] in ("matched", "skipped_opset") for key in record.counts):
        text = _fusion(record)
    else:
        text = ", ".join(_count_phrase(key, value) for key, value in record.counts.items()) or "done"
    return f"{title}: {text} ({record.seconds:.2f} s)"


def variant_sentence(variant: VariantRecord) -> str:
    """e.g. 'fp16 (variants/fp16.onnx): cosine 0.99998, max relative error 0.0012 (the verification inputs)'."""
    figures = ", ".join(METRICS.get(key, key + " {:.4g}").format(value) for key, value in variant.accuracy.items())
    measured = f"{figures} ({variant.evaluated_on})" if figures and variant.evaluated_on else figures
    where = variant.path if variant.shipped else "measured, not shipped: no target runs it"
    return f"{variant.name} ({where}): {measured or 'not verified'}"


def _percent(share: float) -> str:
    """A share as a whole percent that reads neither 0 % nor 100 % when it is neither."""
    if 0 < share < 0.005:
        return "<1 %"
    return ">99 %" if 0.995 <= share < 1 else f"{100 * share:.0f} %"


def _why(floats: list[LayerChoice], budget: str | None) -> str:
    """The float layers grouped by their reason in precision.json, a few names each."""
    groups: dict[str, list[str]] = {}
    for layer in floats:
        groups.setdefault(layer.reason, []).append(layer.module or layer.name)
    clauses = []
    for reason, names in groups.items():
        more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
        searched = budget is not None and reason.startswith(SEARCHED)  # name the budget the search kept it for
        clauses.append(f"{', '.join(names[:NAMED])}{more} ({reason}{f', under {budget}' if searched else ''})")
    return "; ".join(clauses)


def layer_sentence(recipe: RecipePlan, budget: str | None = None) -> str:
    """A quantized variant's layers by precision, counted from its precision.json rows, and why those in float are
    there, e.g. '12 of 14 weight MatMuls in int4 (95 % of their FLOPs), 2 in fp32 (5 %): a, b (input dim 120 is not
    a multiple of 16 (the smallest block))'; 'no layer in int4: ...' where none is quantized."""
    layers, requested = recipe.layers, recipe.precision
    noun = "weight MatMuls" if precision(requested).quantizes is Quantizes.WEIGHTS else "layers"
    total = max(sum(layer.flops for layer in layers), 1)
    groups: dict[str, list[LayerChoice]] = {}
    for layer in layers:
        groups.setdefault(layer.precision, []).append(layer)
    floats = [layer for layer in layers if precision(layer.precision).is_float]
    if len(floats) == len(layers):
        if budget is not None and all(layer.reason.startswith(SEARCHED) for layer in floats):
            return f"no layer in {requested}: the budget {budget} kept all {len(layers)} in {recipe.float_regions}"
        kept = recipe.float_regions if all(layer.precision == recipe.float_regions for layer in layers) else "float"
        return f"no layer in {requested}: all {len(layers)} {noun} in {kept}: {_why(floats, budget)}"
    # the requested precision first, then the other quantized ones, the float ones last; each most layers first
    order = sorted(groups, key=lambda name: (precision(name).is_float, name != requested, -len(groups[name])))
    shares = {name: _percent(sum(layer.flops for layer in groups[name]) / total) for name in order}
    head, *rest = order
    text = ", ".join(
        [
            f"{len(groups[head])} of {len(layers)} {noun} in {head} ({shares[head]} of their FLOPs)",
            *(f"{len(groups[name])} in {name} ({shares[name]})" for name in rest),
        ]
    )
    text += f": {_why(floats, budget)}" if floats else ""
    return text if requested in groups else f"no layer in {requested}; {text}"


def unquantized_variants(plan: PrecisionPlan | None) -> dict[str, str]:
    """The variants named for a quantized precision that hold no quantized layer (every one kept in float), with
    the sentence that says why: `compile --json`'s `unquantized_variants`."""
    if plan is None:
        return {}
    return {
        name: layer_sentence(recipe, plan.budget)
        for name, recipe in plan.recipes.items()
        if recipe.layers
        and all(precision(layer.precision).is_float for layer in recipe.layers)
        and recipe.float_instead is None  # not shipped: the cpu runs the reference
    }


def target_sentence(target: TargetRecord) -> str:
    """e.g. 'cpu: variant fp32 runs on ONNX Runtime, no engine to build'."""
    head = f"{target.name}: variant {target.variant}"
    if target.status == "not-needed":
        return f"{head} {target.reason}, no engine to build" if target.reason else f"{head}, no engine to build"
    if target.status == "built" and target.engine is not None:
        cached = " (reused from the engine cache)" if target.engine.cache == "hit" else ""
        text = f"{head} built with {target.builder} {target.engine.builder_version} → {target.engine.path}{cached}"
        return text + (f"; {target.reason}" if target.reason else "")
    if target.status == "pending":
        return f"{head}, engine pending: {target.reason}"
    return f"{head}, the {target.builder} build failed: {target.reason}"


def artifact_lines(manifest: Manifest, plan: PrecisionPlan | None = None) -> list[str]:
    """The summary's lines after its headline: the source, passes, variants (a quantized one's layers by precision,
    from `plan`, the artifact's precision.json) and targets."""
    canonicalized = next((record for record in manifest.passes if record.name == "canonicalize"), None)
    details = CanonicalizeDetails.read(canonicalized.details) if canonicalized is not None else None
    lines = [f"source: {source_sentence(manifest.source, details.opset_after if details is not None else None)}"]
    if any(step.name.endswith(FROM_EXPORT_CACHE) for step in manifest.steps):
        lines[0] += f"; {FROM_EXPORT_CACHE}"
    lines += [f"pass {pass_sentence(record)}" for record in manifest.passes]
    recipes = plan.recipes if plan is not None else {}
    for variant in manifest.variants:
        recipe = recipes.get(variant.name)
        layers = f"; {layer_sentence(recipe, plan.budget if plan else None)}" if recipe and recipe.layers else ""
        lines.append(f"variant {variant_sentence(variant)}{layers}")
    lines += [f"target {target_sentence(target)}" for target in manifest.targets]
    if manifest.generation is not None:
        why = f" ({manifest.generation.kv_cache_reason})" if manifest.generation.kv_cache_reason else ""
        lines.append(f"generation: {manifest.generation.kv_cache} KV cache{why}")
    return lines
