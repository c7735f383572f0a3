"""`CompileConfig`: everything `compile` needs, read from `tensorsmith.toml` or built from CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import tomllib
from pydantic import Field, ValidationError, field_validator, model_validator

from tensorsmith.compiler.config_errors import usage_error
from tensorsmith.compiler.declarations import DimRange, InputDecl, StrictModel
from tensorsmith.compiler.settings import BuildConfig, GenerationConfig
from tensorsmith.compiler.targets import TARGETS, Request, check_precision, unknown_targets
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.layerwise import Layerwise
from tensorsmith.core.metrics import Budget
from tensorsmith.core.overrides import Override
from tensorsmith.core.precision_record import CAPABILITIES
from tensorsmith.core.precisions import (
    AUTO,
    Calibration,
    Family,
    precision,
    reference_precision,
    requestable,
)
from tensorsmith.core.quantization_declared import declares_quantization

SourceKind = Literal["factory", "exported_program", "onnx", "huggingface"]

DEFAULT_OPSET = 20
# Sizes used for a dynamic dim when exporting and verifying, unless `[dims.NAME] opt` says otherwise (or, for an
# ONNX source's spatial dims, its engines' opt: frontend/feeds.py). Distinct sizes, none of them 0 or 1, so the
# exporters neither specialise a dim nor confuse two of them.
DEFAULT_DYNAMIC_SIZES = (2, 3, 5, 7, 11, 13)
DEFAULT_MAX_SIZE = 64  # a dynamic dim's max (and opt) in engine profiles when the config gives none
# A dim named "batch" without a configured max gets the architecture's default (the target table's max_batch):
# data-centre parts (more memory, serving larger batches) get larger profiles than client GPUs.
BATCH_DIM = "batch"


class _HintedValueError(ValueError):
    """A validator's ConfigError, carried through pydantic (which only catches ValueError) with its hint."""

    def __init__(self, error: ConfigError) -> None:
        super().__init__(error.message)
        self.hint = error.hint


class CompileConfig(StrictModel):
    """What to compile and how. Relative paths are resolved against `base_dir` (the TOML file's folder)."""

    source: str = Field(
        description="a factory 'pkg.module:function', a .pt2 ExportedProgram, an .onnx file, or a Hugging Face "
        "model directory (config.json and safetensors)"
    )
    checkpoint: Path | None = Field(None, description=".safetensors, or .pt/.pth (loaded with weights_only=True)")
    inputs: list[InputDecl] = Field(
        default_factory=list, description="the model's inputs, e.g. input_ids:int64:batch,128 (PyTorch sources)"
    )
    outputs: list[str] = Field(default_factory=list, description="names for the model's outputs, in order")
    dims: dict[str, DimRange] = Field(default_factory=dict, description="a dynamic dim's sizes, as [dims.NAME]")
    dim_sums: dict[str, list[str]] = Field(
        default_factory=dict, description="a dim that is the sum of others, for example feeds (total = past + sequence)"
    )
    opset: int = Field(DEFAULT_OPSET, ge=13, le=23, description="ai.onnx opset of the compiled graph")
    exporter: Literal["auto", "dynamo", "torchscript"] = Field(
        "auto", description="PyTorch's exporter (auto: dynamo, else TorchScript)"
    )
    trace_every_layer: bool = Field(
        False, description="trace every decoder layer in the export, not two with the rest stamped from the second"
    )
    mla_cache: Literal["latent", "full"] = Field(
        "latent",
        description="DeepSeek-V2/V3's attention: cache the compressed latent and rotary key (latent), or every head's "
        "keys and values (full)",
    )
    check_resources: bool = Field(
        True, description="refuse, before any work, a compile whose estimated memory and disk exceed this machine's"
    )
    layerwise: Layerwise = Field(
        "auto",
        description="run the graphs that measure and calibrate one layer at a time (auto: where their weights exceed "
        "a sixth of the available memory)",
    )
    fuse: bool = Field(True, description="run the fusion passes (LayerNorm, GELU, attention scale)")
    precision: Request = Field(
        reference_precision().name,
        description="a precision of the table (core/precisions.py): fp16/bf16: GPU targets compute in it (LayerNorm "
        "kept fp32); int8/fp8: calibrate and quantize every layer the policy allows; int4/nvfp4: weight-only; auto: "
        "per target (int8, or fp8 from sm_89), each layer chosen so that `budget` holds on held-out data",
    )
    budget: str = Field(
        "cosine>=0.995",
        description="for precision auto: METRIC>=VALUE or METRIC<=VALUE (cosine, min-cosine, max-abs, sqnr-db; for "
        "decoders also perplexity-ratio, next-token-agreement, perplexity)",
    )
    overrides: list[Override] = Field(
        default_factory=list, description="[[overrides]] match = glob over node/module/op, precision = fp32|int8|fp8"
    )
    sensitivity_samples: int = Field(16, ge=1, description="evaluation samples used per sensitivity run")
    smoothing: bool = Field(True, description="SmoothQuant scaling before int8 calibration")
    smoothing_alpha: float = Field(0.8, ge=0, le=1, description="SmoothQuant migration strength")
    calibrator: Literal["entropy", "percentile", "minmax"] = Field(
        "entropy",
        description="how activation thresholds are chosen: TensorRT's entropy (KL divergence), a percentile of "
        "|x|, or the min and max",
    )
    percentile: float = Field(99.99, gt=0, le=100, description="for --calibrator percentile")
    int4_algorithm: Literal["awq", "rtn", "checkpoint"] = Field(
        "awq",
        description="for precision int4: AWQ (needs calibration data), round-to-nearest, or the codes of a "
        "pre-quantized checkpoint (a pre-quantized checkpoint's default)",
    )
    int4_block_size: Literal[32, 64, 128] = Field(128, description="for precision int4: weights per scale, along K")
    calibration: Path | None = Field(
        None,
        description=".npz of inputs (samples on axis 0), or a folder of them; for a decoder, a .txt or an .npz of "
        "input_ids",
    )
    calibration_samples: int | None = Field(
        None, ge=1, description="use at most this many calibration samples (a decoder's text: windows; default 64)"
    )
    calibration_stats: str | None = Field(
        None, description="glob of statistics files `tensorsmith calibrate` wrote: merged, in place of --calibration"
    )
    calibration_batch_size: int = Field(16, ge=1, description="samples per ONNX Runtime call while calibrating")
    evaluation: Path | None = Field(
        None, description="held-out .npz to measure variants' accuracy on; default: up to 32 calibration samples"
    )
    tensorrt_cache_version: int = Field(
        101601, description="NV_TENSORRT_VERSION written into calibration/int8.cache (10.16.1 → 101601)"
    )
    targets: list[str] = Field(
        default_factory=lambda: ["cpu"],
        description=f"cpu, or a GPU architecture sm_XX (sm_{CAPABILITIES[0]} to sm_{CAPABILITIES[-1]}); several as a "
        "list (the flag repeated)",
    )
    build: BuildConfig = Field(default_factory=BuildConfig, description="[build]: TensorRT builder settings")
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="[generation]: a decoder's lengths (Hugging Face sources)"
    )
    verify: bool = Field(True, description="compare the compiled graph with the source on ONNX Runtime")
    export_cache_dir: Path | None = Field(
        None,
        description="a directory: reuse the fused graph of an earlier compile of the same checkpoint and export "
        "settings, skipping the export (else $TENSORSMITH_EXPORT_CACHE; keyed by the checkpoint's files, the export "
        "settings and the exporting packages' versions)",
    )
    tolerance: float = Field(1e-4, gt=0, description="max |difference| / max |reference| allowed by verify")
    base_dir: Path = Field(default_factory=Path.cwd, exclude=True)

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: list[str]) -> list[str]:
        unknown = [target for target in targets if target not in TARGETS]
        if unknown:
            raise _HintedValueError(unknown_targets(unknown))
        return list(dict.fromkeys(targets))

    @field_validator("budget")
    @classmethod
    def _budget_parses(cls, budget: str) -> str:
        try:
            Budget.parse(budget)
        except ConfigError as err:
            raise _HintedValueError(err) from err
        return budget

    @model_validator(mode="after")
    def _precision_runs_on_targets(self) -> CompileConfig:
        if self.precision not in requestable():
            raise ValueError(f"unknown precision '{self.precision}'; precision is one of {', '.join(requestable())}")
        try:
            check_precision(self.precision, self.targets)
        except ConfigError as err:
            raise _HintedValueError(err) from err
        if self.calibration_stats is not None and self.calibration is not None:
            raise ValueError("--calibration-stats stands in for --calibration: pass one of them")
        if self.calibration_stats is not None and self.evaluation is None:
            raise ValueError(
                "--calibration-stats needs --eval-data: no calibration samples to hold out for measuring the variants"
            )
        record = None if self.precision == AUTO else precision(self.precision)
        calibrated = record is None or record.calibration is Calibration.ACTIVATIONS
        if calibrated and self.calibration is None and self.calibration_stats is None:
            raise ValueError(f"precision {self.precision} needs calibration data: --calibration PATH")
        # by default an INT4 checkpoint's own codes (an FP8 checkpoint's request is checked when its layout is read:
        # quantized_checkpoint.checkpoint_precision)
        awq = record is not None and record.calibration is Calibration.OPTIONAL_AWQ and self.int4_algorithm == "awq"
        stored = "int4_algorithm" not in self.model_fields_set and declares_quantization(self.resolve(self.source))
        if awq and self.calibration is None and not stored:
            raise ValueError(
                f"precision {self.precision} with awq needs calibration data: --calibration PATH (or "
                "--int4-algorithm rtn); random inputs are never used in its place"
            )
        if record is not None and record.family is Family.FP8_WEIGHTS and self.overrides:
            raise ValueError(
                f"[[overrides]] are not taken under {record.name}: every weight MatMul it can take is "
                "stored in it (pin layers under int4 or a decoder's auto)"
            )
        weight_only = record is None or record.family is Family.WEIGHT_ONLY
        for override in self.overrides:
            if precision(override.precision).family is Family.WEIGHT_ONLY and not weight_only:
                raise ValueError(
                    f"[[overrides]] match '{override.match}': {override.precision} pins weight layers "
                    f"under a weight-only precision or a decoder's auto, not {self.precision}"
                )
        if record is not None and self.opset < record.min_opset and "opset" in self.model_fields_set:
            raise ValueError(f"precision {record.name} needs opset {record.min_opset} or newer, not {self.opset}")
        return self

    @model_validator(mode="after")
    def _names_unique(self) -> CompileConfig:
        names = [decl.name for decl in self.inputs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"inputs declared twice: {duplicates}")
        return self

    def accuracy_budget(self) -> Budget | None:
        """The budget `--precision auto` chooses layers against (validated with the config); None otherwise."""
        return Budget.parse(self.budget) if self.precision == "auto" else None

    @property
    def source_kind(self) -> SourceKind:
        resolved = self.resolve(self.source)
        if resolved.is_dir() and (resolved / "config.json").is_file():
            return "huggingface"  # a save_pretrained directory
        if self.source.endswith(".onnx"):
            return "onnx"
        if self.source.endswith(".pt2"):
            return "exported_program"
        return "factory"

    def resolve(self, path: Path | str) -> Path:
        path = Path(path).expanduser()
        return path if path.is_absolute() else self.base_dir / path

    def example_sizes(self) -> dict[str, int]:
        """Each named dynamic dim's declared opt, else a small distinct size (frontend/feeds.py refines these)."""
        sizes: dict[str, int] = {}
        fallback = iter(DEFAULT_DYNAMIC_SIZES)
        for decl in self.inputs:
            for dim in decl.dims:
                if isinstance(dim, str) and dim not in sizes:
                    configured = self.dims.get(dim)
                    default = next(fallback, 4)
                    sizes[dim] = configured.opt if configured and configured.opt else default
        return self.with_sums(sizes)

    def with_sums(self, sizes: dict[str, int]) -> dict[str, int]:
        """`sizes` with each `dim_sums` dim set to the sum of its parts."""
        return {**sizes, **{dim: sum(sizes[part] for part in parts) for dim, parts in self.dim_sums.items()}}

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: object) -> CompileConfig:
        """Read a `tensorsmith.toml`; `overrides` (e.g. from CLI flags) replace its top-level keys."""
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError as err:
            raise ConfigError(f"{path} does not exist", hint="check the path to tensorsmith.toml") from err
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"{path} is not valid TOML: {err}", hint="see samples/*/tensorsmith.toml") from err
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key] = {**raw[key], **value}  # a table (e.g. [build]) gets the flag's keys merged in
            elif value is not None:
                raw[key] = value
        return cls.create(raw, origin=str(path), base_dir=path.resolve().parent)

    @classmethod
    def create(
        cls, raw: dict[str, object], origin: str = "command line", base_dir: Path | None = None
    ) -> CompileConfig:
        """Validate `raw`; an error names the field and where it came from (`origin`)."""
        try:
            config = cls.model_validate({**raw, "base_dir": base_dir or Path.cwd()})
        except ValidationError as err:
            raise usage_error(err, origin, cls) from err
        return config
