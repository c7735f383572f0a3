"""The precision record: what a precision stores (element, block, scales), what it needs (calibration, opset),
who runs it (GPU compute capabilities, cpu backends) and which variant builder family writes it. The table of
records, and the questions the code asks it, are core/precisions.py."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tensorsmith.core.elements import Element
from tensorsmith.runtime.backends import BackendSpec, cpu_backends


class Quantizes(str, Enum):
    NOTHING = "nothing"  # a float precision: the whole graph computes in it
    WEIGHTS = "weights"  # weight-only: activations stay in the variant's float precision
    WEIGHTS_AND_ACTIVATIONS = "weights and activations"  # Q/DQ on both inputs of each layer (W8A8)


class Calibration(str, Enum):
    NONE = "none"
    ACTIVATIONS = "activation ranges"  # entropy/percentile/minmax thresholds over calibration data
    OPTIONAL_AWQ = "AWQ statistics (optional: round-to-nearest needs none)"


class Family(str, Enum):
    """The variant builder that writes a precision (compiler/variants/stage.BUILDERS has one per family)."""

    FLOAT = "float"  # the graph in a float type: the fp32 reference, fp16 / bf16 regions
    CALIBRATED = "calibrated"  # per-tensor activation scales from calibration, per-channel weights
    WEIGHT_ONLY = "weight-only"  # weights stored narrow, dequantized before the MatMul (a decoder's levels)
    FP8_WEIGHTS = "fp8 weight-only"  # float8 weights in blocks: a checkpoint's own, or rounded to nearest


CPU_BACKENDS = cpu_backends()  # runtime/backends.py: the rows that run the cpu target's variant

# Compute capabilities of the target table's GPUs, oldest first (compiler/targets.py has a row each).
CAPABILITIES = (75, 80, 86, 87, 89, 90, 100, 120, 121)


def from_capability(first: int) -> frozenset[int]:
    return frozenset(capability for capability in CAPABILITIES if capability >= first)


@dataclass(frozen=True)
class Precision:
    name: str  # as the CLI, overrides, the manifest and precision.json spell it
    element: Element
    quantizes: Quantizes
    family: Family
    description: str
    capabilities: frozenset[int]  # GPUs (compute capability × 10) whose engines run it
    cpu_backends: tuple[BackendSpec, ...] = ()  # the cpu target's backends that run it
    block: int | None = None  # weights per scale along K; None: a scale per output channel (or none)
    block_from_config: bool = False  # the block is the compile's (`--int4-block-size`), `block` its default
    scale: str = ""  # the scale format, in words
    scale_element: Element | None = None  # the scales' type; None: the variant's float regions' (fp32, fp16)
    tensor_scale: Element | None = None  # a second-level scale, one per tensor (NVFP4's float32)
    calibration: Calibration = Calibration.NONE
    min_opset: int = 13  # the ONNX opset its graph form needs
    requestable: bool = True  # `--precision NAME`; False: a level the search and [[overrides]] pick per layer
    overridable: bool = False  # `[[overrides]] precision = NAME`
    decoder_level: bool = False  # a weight level a decoder's auto may give a layer
    preference: int = 0  # `tensorsmith build` on an old artifact: the most quantized variant it runs first
    reference: bool = False  # what every variant is measured against; every target serves it (fp16 without fp32 GEMM)

    def runs_on(self, capability: int | None) -> bool:
        """Whether a GPU of `capability` (None: the cpu target) runs it."""
        return bool(self.cpu_backends) if capability is None else capability in self.capabilities

    @property
    def is_float(self) -> bool:
        return self.quantizes is Quantizes.NOTHING

    @property
    def quantizes_activations(self) -> bool:
        return self.quantizes is Quantizes.WEIGHTS_AND_ACTIVATIONS

    def stored_bytes(self, rows: int, columns: int, floats: Element, block: int | None = None) -> int:
        """Bytes of a [rows (K), columns (N)] weight stored in this precision, in a variant whose float regions are
        of type `floats`: its codes, a scale per block of K (or per column) and column, and the tensor's scale.
        `block`: the compile's, for a record whose block is configurable."""
        codes = rows * columns * self.element.bits // 8
        if self.is_float:
            return codes
        along_k = (block if self.block_from_config and block else self.block) or rows
        scales = rows // along_k * columns * (self.scale_element or floats).bits // 8
        return codes + scales + (self.tensor_scale.bits // 8 if self.tensor_scale else 0)
