"""Build a TensorRT engine from an ONNX graph for one target architecture.

One builder serves both flavours, parameterized by the module: `tensorrt_rtx` (TensorRT for RTX) builds ahead of
time for any of its architectures on any machine, a CPU-only one included; `tensorrt` (data-centre TensorRT)
builds for the GPU it runs on. Networks are strongly typed: precision comes from the graph (Q/DQ, Casts), never
from builder flags. Both modules are imported lazily, here only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from tensorsmith.compiler.config import DimRange
from tensorsmith.compiler.engine_cache import cache_key, configured_cache
from tensorsmith.compiler.errors import BuildError
from tensorsmith.runtime.manifest import TensorRecord, sha256_of

if TYPE_CHECKING:
    # The TensorRT API as tensorrt-stubs types it (scripts/tensorrt-stubs.sh puts the stubs on MYPYPATH for
    # `make lint`); without them these names are Any. tensorrt_rtx has the same classes, plus the
    # compute-capability settings of its builder config, which are reached through `Any` below.
    import tensorrt as trt_api

logger = logging.getLogger(__name__)

Builder = Literal["tensorrt-rtx", "tensorrt"]
BUILDER_MODULES: dict[str, str] = {"tensorrt-rtx": "tensorrt_rtx", "tensorrt": "tensorrt"}
# Architectures TensorRT for RTX builds for, by target name → its ComputeCapability member.
RTX_ARCHITECTURES = {
    "sm_75": "SM75",
    "sm_80": "SM80",
    "sm_86": "SM86",
    "sm_89": "SM89",
    "sm_120": "SM120",
    "sm_121": "SM121",
}
DEFAULT_MAX_SIZE = 64  # a dynamic dim's max when the config gives none
# A dim named "batch" without a configured max gets the architecture's default: data-centre parts (more
# memory, serving larger batches) get larger profiles than client GPUs.
BATCH_DIM = "batch"
DEFAULT_MAX_BATCH = {"sm_75": 32, "sm_80": 128, "sm_90": 256, "sm_100": 256}
PARSER_ERRORS_SHOWN = 5
HardwareCompatibility = Literal["none", "ampere+", "same-compute-capability"]
HARDWARE_COMPATIBILITY = {
    "none": "NONE",
    "ampere+": "AMPERE_PLUS",
    "same-compute-capability": "SAME_COMPUTE_CAPABILITY",
}


@dataclass(frozen=True)
class BuildOptions:
    """Builder settings beyond the profile (all optional; TensorRT's defaults otherwise)."""

    optimization_level: int | None = None  # 0–5: higher searches more tactics, builds slower
    workspace_bytes: int | None = None
    hardware_compatibility: HardwareCompatibility = "none"
    detailed_profiling: bool = True  # layer names and precisions visible to the engine inspector
    timing_cache_dir: Path | None = None  # data-centre TensorRT only: TensorRT for RTX makes the cache a no-op
    cache_dir: Path | None = (
        None  # built engines by content (compiler/engine_cache.py); None: $TENSORSMITH_ENGINE_CACHE
    )


@dataclass
class Profile:
    """One optimization profile: (min, opt, max) shapes per input."""

    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    def as_record(self) -> dict[str, object]:
        return {name: {"min": s[0], "opt": s[1], "max": s[2]} for name, s in self.shapes.items()}


def profile_for(inputs: Sequence[TensorRecord], dims: Mapping[str, DimRange], target: str | None = None) -> Profile:
    """Min/opt/max shapes from the declared dims: `[dims.NAME] min/opt/max`, else 1 / max / 64 (for `batch`,
    the target architecture's default max, DEFAULT_MAX_BATCH)."""
    shapes = {}
    for record in inputs:
        low: list[int] = []
        best: list[int] = []
        high: list[int] = []
        for dim in record.shape:
            if isinstance(dim, int):
                sizes = (dim, dim, dim)
            else:
                limits = dims.get(dim, DimRange())
                default = (
                    DEFAULT_MAX_BATCH.get(target or "", DEFAULT_MAX_SIZE) if dim == BATCH_DIM else DEFAULT_MAX_SIZE
                )
                maximum = limits.max or max(limits.opt or 1, default)
                sizes = (limits.min, limits.opt or maximum, maximum)
            for bound, size in zip((low, best, high), sizes, strict=True):
                bound.append(size)
        shapes[record.name] = (tuple(low), tuple(best), tuple(high))
    return Profile(shapes)


@dataclass
class BuiltEngine:
    plan: bytes
    builder: Builder
    builder_version: str
    compute_capability: str
    profiles: list[dict[str, object]]
    seconds: float
    warnings: list[str] = field(default_factory=list)
    timing_cache: dict[str, int | str] = field(default_factory=dict)  # entries before/after, or why none
    cache: Literal["hit", "miss", "off"] = "off"  # the engine cache (compiler/engine_cache.py)


def import_builder(builder: Builder) -> ModuleType:
    try:
        return importlib.import_module(BUILDER_MODULES[builder])
    except ImportError as err:
        hint = "pip install 'tensorsmith[rtx]'" if builder == "tensorrt-rtx" else "install TensorRT for your CUDA"
        raise BuildError(f"the {builder} builder is not installed ({err})", hint=hint) from err


def _logger(trt: ModuleType, messages: list[tuple[Any, str]]) -> Any:
    """A TensorRT logger that forwards to `logging` and keeps warnings and errors for BuildError messages."""

    class ForwardingLogger(trt.ILogger):  # type: ignore[name-defined]
        def log(self, severity: Any, message: str) -> None:
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                logger.error("TensorRT: %s", message)
                messages.append((severity, message))
            elif severity == trt.ILogger.WARNING:
                # TensorRT warns about routine things (int64 bindings); kept in the engine record, logged at info.
                logger.info("TensorRT: %s", message)
                messages.append((severity, message))
            else:
                logger.debug("TensorRT: %s", message)

    return ForwardingLogger()


@contextlib.contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """TensorRT for RTX prints some warnings from native code straight to file descriptor 1; send them to 2
    while it works, so `--json` keeps stdout one JSON object."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _parse(network: trt_api.INetworkDefinition, parser: trt_api.OnnxParser, onnx_path: Path) -> None:
    if parser.parse_from_file(str(onnx_path)):
        return
    errors = [parser.get_error(i) for i in range(parser.num_errors)]
    described = [f"node '{error.node_name()}' ({error.node_operator()}): {error.desc().strip()}" for error in errors]
    more = f" … and {len(described) - PARSER_ERRORS_SHOWN} more" if len(described) > PARSER_ERRORS_SHOWN else ""
    raise BuildError(
        f"TensorRT could not parse {onnx_path}: {'; '.join(described[:PARSER_ERRORS_SHOWN])}{more}",
        hint="these nodes use ops or types TensorRT's ONNX parser does not support; `tensorsmith inspect` lists ops",
    )


def build_engine(
    onnx_path: Path,
    target: str,
    profile: Profile,
    builder: Builder = "tensorrt-rtx",
    options: BuildOptions = BuildOptions(),
    onnx_sha256: str | None = None,
) -> BuiltEngine:
    """Build a serialized engine for `target` (e.g. "sm_86") from the ONNX graph at `onnx_path`, or take it
    from the engine cache when one is configured (`onnx_sha256`: the file's, if the caller has it already)."""
    trt = import_builder(builder)
    if builder == "tensorrt-rtx" and target not in RTX_ARCHITECTURES:
        raise BuildError(
            f"tensorrt-rtx does not build for {target}",
            hint=f"it builds for {sorted(RTX_ARCHITECTURES)}; build {target} with tensorrt on a {target} GPU",
        )
    started = time.perf_counter()
    version = str(trt.__version__)
    engines = configured_cache(options.cache_dir)
    if engines is None:
        with native_stdout_to_stderr():
            return _build(trt, onnx_path, target, profile, builder, options)
    key = cache_key(onnx_sha256 or sha256_of(onnx_path), target, builder, version, profile, options)
    cached = engines.get(key)
    if cached is not None:
        logger.info("engine cache hit for %s (%s): %s", target, onnx_path.name, key[:12])
        return BuiltEngine(
            plan=cached,
            builder=builder,
            builder_version=version,
            compute_capability=target,
            profiles=[profile.as_record()],
            seconds=round(time.perf_counter() - started, 3),
            timing_cache={"status": "not needed: the engine came from the engine cache"},
            cache="hit",
        )
    with native_stdout_to_stderr():
        built = _build(trt, onnx_path, target, profile, builder, options)
    engines.put(key, built.plan)
    return dataclasses.replace(built, cache="miss")


def _build(
    trt: ModuleType, onnx_path: Path, target: str, profile: Profile, builder: Builder, options: BuildOptions
) -> BuiltEngine:
    started = time.perf_counter()
    messages: list[tuple[Any, str]] = []
    trt_logger = _logger(trt, messages)
    network_builder: trt_api.Builder = trt.Builder(trt_logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = network_builder.create_network(flags)
    parser: trt_api.OnnxParser = trt.OnnxParser(network, trt_logger)
    _parse(network, parser, onnx_path)

    config = network_builder.create_builder_config()
    if builder == "tensorrt-rtx":
        rtx_config: Any = config  # TensorRT for RTX's own settings: not in data-centre TensorRT's API
        rtx_config.num_compute_capabilities = 1
        rtx_config.set_compute_capability(getattr(trt.ComputeCapability, RTX_ARCHITECTURES[target]), 0)
    if options.optimization_level is not None:
        config.builder_optimization_level = options.optimization_level
    if options.workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    config.hardware_compatibility_level = getattr(
        trt.HardwareCompatibilityLevel, HARDWARE_COMPATIBILITY[options.hardware_compatibility]
    )
    if options.detailed_profiling:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    cache = _TimingCache(trt, config, builder, target, options.timing_cache_dir)
    optimization_profile = network_builder.create_optimization_profile()
    for index in range(network.num_inputs):
        name = network.get_input(index).name
        if name not in profile.shapes:
            raise BuildError(f"no profile shapes for input '{name}'", hint="declare its dims in the config")
        low, best, high = (trt.Dims(shape) for shape in profile.shapes[name])
        optimization_profile.set_shape(name, low, best, high)
    config.add_optimization_profile(optimization_profile)

    plan = network_builder.build_serialized_network(network, config)
    timing = cache.save()
    if plan is None:
        errors = [message for severity, message in messages if severity != trt.ILogger.WARNING]
        raise BuildError(
            f"TensorRT ({builder}) could not build {onnx_path.name} for {target}: "
            + ("; ".join(errors[-3:]) or "no error message"),
            hint="run with -vv for TensorRT's log",
        )
    return BuiltEngine(
        plan=bytes(plan),
        builder=builder,
        builder_version=str(trt.__version__),
        compute_capability=target,
        profiles=[profile.as_record()],
        seconds=round(time.perf_counter() - started, 3),
        warnings=[message for severity, message in messages if severity == trt.ILogger.WARNING],
        timing_cache=timing,
    )


class _TimingCache:
    """A timing cache per (target, builder, version) under `directory`, loaded before a build and saved after;
    TensorRT for RTX makes timing caches no-ops, so it is used with data-centre TensorRT only."""

    def __init__(
        self, trt: ModuleType, config: trt_api.IBuilderConfig, builder: Builder, target: str, directory: Path | None
    ) -> None:
        self.config = config
        self.path = None
        self.reason = ""
        if builder == "tensorrt-rtx":
            self.reason = "not used: TensorRT for RTX makes timing caches no-ops"
        elif directory is None:
            self.reason = "not used: no timing_cache_dir"
        else:
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / f"{target}-{builder}-{trt.__version__}.cache"
            data = self.path.read_bytes() if self.path.is_file() else b""
            self.cache = config.create_timing_cache(data)
            config.set_timing_cache(self.cache, ignore_mismatch=False)
            self.before = len(self.cache.queryKeys())

    def save(self) -> dict[str, int | str]:
        if self.path is None:
            return {"status": self.reason}
        cache = self.config.get_timing_cache()
        data = bytes(cache.serialize())
        self.path.write_bytes(data)
        after = len(cache.queryKeys())
        logger.info("timing cache %s: %d entries reused, %d new", self.path.name, self.before, after - self.before)
        return {"path": str(self.path), "entries_reused": self.before, "entries_added": after - self.before}
