"""The precision table: every precision tensorsmith writes is one record here, and every other place asks it.

A record says what the precision stores (element format, what it quantizes, block size and scale format), what
it needs (calibration, opset), who runs it (GPU compute capabilities, cpu backends) and which variant builder
family writes it (compiler/variants/builders.py). The CLI's `--precision` choices, `[[overrides]]`, the target
rows, `tensorsmith build`'s preference and the opset floors all read these records: adding a precision is one
record (its type: core/precision_record.py) and, for a weight format, one module (passes/weight_formats).
tests/test_precision_vocabulary.py fails if a precision name is spelled as a string literal outside this file
and the tests.

Modelled on Model Optimizer's quantization configs (`modelopt/torch/quantization/config.py`: formats and blocks
as data) while the pipeline that reads them stays in code.
"""

from __future__ import annotations

from tensorsmith.core.elements import Element
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.precision_record import (
    CPU_BACKENDS,
    Calibration,
    Family,
    Precision,
    Quantizes,
    from_capability,
)

FP32 = Precision(
    "fp32",
    Element.FP32,
    Quantizes.NOTHING,
    Family.FLOAT,
    "the reference: every layer in float32",
    from_capability(80),  # TensorRT for RTX has no fp32 GEMM on Turing (checked)
    CPU_BACKENDS,
    overridable=True,
    preference=1,
    reference=True,
)
FP16 = Precision(
    "fp16",
    Element.FP16,
    Quantizes.NOTHING,
    Family.FLOAT,
    "GPU targets compute in float16 (LayerNorm kept float32); the cpu target keeps fp32",
    from_capability(75),
    preference=2,
)
BF16 = Precision(
    "bf16",
    Element.BF16,
    Quantizes.NOTHING,
    Family.FLOAT,
    "GPU targets compute in bfloat16 (float32's range: no overflow where fp16 would); sm_75 gets fp16",
    from_capability(80),  # tensorrt-rtx 1.7 builds bf16 MatMuls for SM86/89/120, not SM75 (checked)
    preference=3,
)
INT8 = Precision(
    "int8",
    Element.INT8,
    Quantizes.WEIGHTS_AND_ACTIVATIONS,
    Family.CALIBRATED,
    "int8 weights (a scale per output channel) and activations (per tensor, calibrated)",
    from_capability(75),
    CPU_BACKENDS,
    scale="float32, per output channel / per tensor",
    calibration=Calibration.ACTIVATIONS,
    overridable=True,
    decoder_level=True,
    preference=5,
)
FP8 = Precision(
    "fp8",
    Element.FP8_E4M3,
    Quantizes.WEIGHTS_AND_ACTIVATIONS,
    Family.CALIBRATED,
    "float8 e4m3 weights and activations (scale = amax / 448), Ada and newer",
    from_capability(89),
    scale="float32, per output channel / per tensor",
    calibration=Calibration.ACTIVATIONS,
    min_opset=19,
    overridable=True,
    decoder_level=True,
    preference=6,
)
INT8_WEIGHT = Precision(
    "int8-weight",
    Element.INT8,
    Quantizes.WEIGHTS,
    Family.WEIGHT_ONLY,
    "int8 weights only (a scale per output channel), dequantized before the MatMul",
    from_capability(75),
    CPU_BACKENDS,
    scale="float32, per output channel",
    requestable=False,
    overridable=True,
    decoder_level=True,
)
INT4 = Precision(
    "int4",
    Element.INT4,
    Quantizes.WEIGHTS,
    Family.WEIGHT_ONLY,
    "int4 weights only, blockwise DequantizeLinear (AWQ or round-to-nearest); MatMulNBits on ONNX Runtime",
    from_capability(80),  # tensorrt-rtx builds INT4 MatMuls for SM86/89/120, not SM75 (checked)
    CPU_BACKENDS,
    block=128,
    block_from_config=True,
    scale="float32 per block of K and output column",
    calibration=Calibration.OPTIONAL_AWQ,
    min_opset=21,
    overridable=True,
    decoder_level=True,
    preference=7,
)
NVFP4 = Precision(
    "nvfp4",
    Element.FP4_E2M1,
    Quantizes.WEIGHTS,
    Family.WEIGHT_ONLY,
    "float4 e2m1 weights only in blocks of 16, float8 e4m3 block scales × a float32 tensor scale (Blackwell)",
    frozenset({100, 120, 121}),  # tensorrt-rtx 1.7 builds it for SM120, refuses SM86/SM89 ("fp4_e2m1", checked)
    block=16,
    scale="float8 e4m3 per block of 16 × float32 per tensor (two DequantizeLinear)",
    scale_element=Element.FP8_E4M3,
    tensor_scale=Element.FP32,
    min_opset=23,
    overridable=True,
    decoder_level=True,
    preference=8,
)

MXFP4 = Precision(
    "mxfp4",
    Element.FP4_E2M1,
    Quantizes.WEIGHTS,
    Family.WEIGHT_ONLY,
    "float4 e2m1 weights only in blocks of 32, a power-of-two scale each (OCP MX; gpt-oss's experts as published, "
    "kept as float32 scales: exact), Blackwell",
    # tensorrt-rtx 1.7 builds its FLOAT4E2M1 DequantizeLinear with float32 scales for SM120 and SM121 (checked)
    frozenset({120, 121}),
    block=32,
    scale="a power of two per block of 32 (e8m0), held in float32",
    scale_element=Element.FP32,
    min_opset=23,
)
FP8_WEIGHT = Precision(
    "fp8-weight",
    Element.FP8_E4M3,
    Quantizes.WEIGHTS,
    Family.FP8_WEIGHTS,
    "float8 e4m3 weights only, a float32 scale per block of K and output column (an FP8 checkpoint's codes as "
    "stored, or rounded to nearest), dequantized before the MatMul; Ada and newer",
    from_capability(89),  # tensorrt-rtx 1.7 builds blockwise FLOAT8E4M3FN DequantizeLinear for SM89/SM120, not SM86
    block=128,
    scale="float32 per block of K and output column",
    min_opset=21,
)

PRECISIONS: dict[str, Precision] = {
    precision.name: precision
    for precision in (FP32, FP16, BF16, INT8, FP8, INT8_WEIGHT, INT4, NVFP4, MXFP4, FP8_WEIGHT)
}
AUTO = "auto"  # not a precision: `--precision auto` chooses one per layer against a budget


def precision(name: str) -> Precision:
    """The record named `name`; a ConfigError naming the known ones otherwise."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ConfigError(f"unknown precision '{name}'", hint=f"precisions are {', '.join(PRECISIONS)}") from None


def requestable() -> list[str]:
    """`--precision`'s choices, in the table's order, and auto."""
    return [record.name for record in PRECISIONS.values() if record.requestable] + [AUTO]


def overridable() -> list[str]:
    """`[[overrides]] precision = ...`'s choices."""
    return [record.name for record in PRECISIONS.values() if record.overridable]


def in_family(family: Family) -> tuple[Precision, ...]:
    return tuple(record for record in PRECISIONS.values() if record.family is family)


def decoder_levels() -> tuple[Precision, ...]:
    """The weight levels a decoder's auto may give a layer, in the table's order."""
    return tuple(record for record in PRECISIONS.values() if record.decoder_level)


def storing(element: Element, block: int | None = None) -> Precision:
    """The weight-only precision whose codes are `element` values (in blocks of `block` along K, where given): a
    pre-quantized checkpoint's own level. Of several, the table's first (a Linear's e2m1 codes are NVFP4's;
    gpt-oss's MXFP4 experts ask for blocks of 32)."""
    found = [
        r
        for r in PRECISIONS.values()
        if r.element is element and r.quantizes is Quantizes.WEIGHTS and (block is None or r.block == block)
    ]
    if not found:
        raise ConfigError(f"no weight-only precision stores {element.value} codes", hint="a checkpoint format to add")
    return found[0]


def reference_precision() -> Precision:
    """The record every variant is measured against: fp32."""
    return next(record for record in PRECISIONS.values() if record.reference)


def float_regions(on_gpu: bool) -> Precision:
    """What a quantized variant computes its unquantized layers in: fp16 on a GPU (every GPU of the table runs
    it), fp32 on the cpu (ONNX Runtime's CPU kernels are fp32)."""
    return FP16 if on_gpu else FP32


def float_served(record: Precision, capability: int | None) -> Precision:
    """What a target computes a float request in: the cpu fp32 whatever the GPUs take (the reference); a GPU the
    request where it runs it, else fp16 (sm_75 has no bf16 and no fp32 GEMM)."""
    if capability is None:
        return FP32
    return record if record.runs_on(capability) else FP16


def calibrated_for_auto(capability: int | None) -> Precision:
    """The calibrated precision an encoder's `auto` takes on a target: the most quantized one it runs (fp8 on Ada
    and newer, int8 elsewhere)."""
    return max((r for r in in_family(Family.CALIBRATED) if r.runs_on(capability)), key=lambda r: r.preference)


def weight_only_request(request: str, weight_only: bool = True) -> Precision | None:
    """The weight-only precision a `--precision` request asks for: itself, or INT4 for `auto` where the model's
    auto mixes weight levels (`weight_only`: a decoder's); None for any other request."""
    if request == AUTO:
        return INT4 if weight_only else None
    record = precision(request)
    return record if record.quantizes is Quantizes.WEIGHTS else None


def stored_on_cpu(record: Precision) -> Precision | None:
    """What the cpu variant of a decoder's mix stores for a layer at `record`: weights only, at the weight-only
    decoder level of as many bits that the cpu runs (ONNX Runtime's CPU runs a decoder's W8A8 pairs slower than
    int8 weight-only, fp8 and nvfp4 not at all)."""
    if record.quantizes is Quantizes.WEIGHTS and record.runs_on(None):
        return record
    for level in decoder_levels():
        if level.quantizes is Quantizes.WEIGHTS and level.runs_on(None) and level.element.bits == record.element.bits:
            return level
    return None  # the cpu runs no weight-only level of as many bits


def by_preference() -> list[Precision]:
    """The most quantized first: what `tensorsmith build` picks from an artifact that recorded no request."""
    return sorted((record for record in PRECISIONS.values() if record.preference), key=lambda r: -r.preference)
