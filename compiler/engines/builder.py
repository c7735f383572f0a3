"""Build a TensorRT engine from an ONNX graph for one target architecture.

One builder serves both flavours, parameterized by the module: `tensorrt_rtx` (TensorRT for RTX) builds ahead of
time for any of its architectures on any machine, a CPU-only one included; `tensorrt` (data-centre TensorRT)
builds for the GPU it runs on. Networks are strongly typed: precision comes from the graph (Q/DQ, Casts), never
from builder flags. Both modules are imported lazily, here only.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal, Protocol, cast

from tensorsmith.compiler.engines.engine_cache import cache_key, configured_cache
from tensorsmith.compiler.engines.isolated import run_isolated
from tensorsmith.compiler.engines.mapped_parse import parsed_network
from tensorsmith.compiler.engines.plan_stream import build_to_stream
from tensorsmith.compiler.engines.profile import Profile, as_profiles
from tensorsmith.compiler.engines.timing_cache import TimingCache
from tensorsmith.compiler.settings import BuildConfig
from tensorsmith.compiler.targets import Builder, get_target
from tensorsmith.core.errors import BuildError
from tensorsmith.core.files import current_umask, replace_file
from tensorsmith.runtime.manifest import sha256_of

if TYPE_CHECKING:
    # The TensorRT API as tensorrt-stubs types it (scripts/tensorrt-stubs.sh puts the stubs on MYPYPATH for
    # `make lint`). tensorrt_rtx has the same classes, plus the compute-capability settings of its builder
    # config (RtxBuilderConfig), and no stubs.
    import tensorrt as trt_api

logger = logging.getLogger(__name__)

BUILDER_MODULES: dict[Builder, str] = {"tensorrt-rtx": "tensorrt_rtx", "tensorrt": "tensorrt"}
HARDWARE_COMPATIBILITY = {
    "none": "NONE",
    "ampere+": "AMPERE_PLUS",
    "same-compute-capability": "SAME_COMPUTE_CAPABILITY",
}


class RtxBuilderConfig(Protocol):
    """TensorRT for RTX's builder config settings that data-centre TensorRT's has not."""

    num_compute_capabilities: int

    def set_compute_capability(self, capability: object, index: int) -> None: ...


@dataclass
class BuiltEngine:
    plan: bytes  # empty where the plan went straight to a file (`plan_path`)
    builder: Builder
    builder_version: str
    compute_capability: str
    profiles: list[dict[str, object]]
    seconds: float
    profile_names: list[str] = field(default_factory=list)  # a decoder's: prefill, decode
    warnings: list[str] = field(default_factory=list)
    timing_cache: dict[str, int | str] = field(default_factory=dict)  # entries before/after, or why none
    cache: Literal["hit", "miss", "off"] = "off"  # the engine cache (compiler/engine_cache.py)
    plan_path: Path | None = None  # where the plan was written, when build_engine was given a destination

    @property
    def size(self) -> int:
        """The serialized plan's bytes, in memory or in its file."""
        return self.plan_path.stat().st_size if self.plan_path is not None else len(self.plan)


def import_builder(builder: Builder) -> ModuleType:
    try:
        return importlib.import_module(BUILDER_MODULES[builder])
    except ImportError as err:
        hint = "pip install 'tensorsmith[rtx]'" if builder == "tensorrt-rtx" else "install TensorRT for your CUDA"
        raise BuildError(f"the {builder} builder is not installed ({err})", hint=hint) from err


def _logger(trt: ModuleType, messages: list[tuple[trt_api.ILogger.Severity, str]]) -> trt_api.ILogger:
    """A TensorRT logger that forwards to `logging` and keeps warnings and errors for BuildError messages."""

    class ForwardingLogger(trt.ILogger):  # type: ignore[name-defined]
        def log(self, severity: trt_api.ILogger.Severity, message: str) -> None:
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                logger.info("TensorRT: %s", message)  # worded once, by the BuildError that carries it
                messages.append((severity, message))
            elif severity == trt.ILogger.WARNING:
                # TensorRT warns about routine things (int64 bindings); kept in the engine record, logged at info.
                logger.info("TensorRT: %s", message)
                messages.append((severity, message))
            else:
                logger.debug("TensorRT: %s", message)

    return ForwardingLogger()


def build_engine(
    onnx_path: Path,
    target: str,
    profile: Profile | Sequence[Profile],
    builder: Builder = "tensorrt-rtx",
    options: BuildConfig | None = None,
    onnx_sha256: str | None = None,
    destination: Path | None = None,
) -> BuiltEngine:
    """Build a serialized engine for `target` (e.g. "sm_86") from the ONNX graph at `onnx_path`, or take it
    from the engine cache when one is configured (`onnx_sha256`: the file's, if the caller has it already).

    With a `destination`, the plan goes there whole (a temporary sibling renamed into place) and never through
    this process's memory: a 1B decoder's plans are 3 GB each, built side by side."""
    options = options or BuildConfig()
    profiles = as_profiles(profile)
    trt = import_builder(builder)
    builders = get_target(target).builders
    if builder not in builders:
        raise BuildError(
            f"{builder} does not build for {target}",
            hint=f"{target} is built by {' or '.join(builders)}" if builders else f"{target} runs on ONNX Runtime",
        )
    started = time.perf_counter()
    version = str(trt.__version__)
    engines = configured_cache(options.engine_cache_dir)
    if engines is None:
        return _build_isolated(builder, onnx_path, target, profiles, options, destination)
    key = cache_key(onnx_sha256 or sha256_of(onnx_path), target, builder, version, profiles, options)
    cached = engines.get(key)
    if cached is not None:
        logger.info("engine cache hit for %s (%s): %s", target, onnx_path.name, key[:12])
        if destination is not None:
            replace_file(destination, cached)
        return BuiltEngine(
            plan=b"" if destination is not None else cached,
            plan_path=destination,
            builder=builder,
            builder_version=version,
            compute_capability=target,
            profiles=[p.as_record() for p in profiles],
            profile_names=[p.name for p in profiles if p.name],
            seconds=round(time.perf_counter() - started, 3),
            timing_cache={"status": "not needed: the engine came from the engine cache"},
            cache="hit",
        )
    built = _build_isolated(builder, onnx_path, target, profiles, options, destination)
    if built.plan_path is not None:
        engines.put_file(key, built.plan_path)
    else:
        engines.put(key, built.plan)
    return dataclasses.replace(built, cache="miss")


def _build_isolated(
    builder: Builder,
    onnx_path: Path,
    target: str,
    profiles: list[Profile],
    options: BuildConfig,
    destination: Path | None = None,
) -> BuiltEngine:
    """`_build` in a child process (compiler/engines/isolated.py): a crash in TensorRT fails this target only.
    The child writes the plan to a file: `destination`'s temporary sibling, renamed into place once it is whole,
    or a scratch file read back when the caller wants the bytes."""
    scratch_parent = destination.parent if destination is not None else None
    with tempfile.TemporaryDirectory(prefix=".tensorsmith-engine-", dir=scratch_parent) as scratch:
        plan_path = Path(scratch) / "engine.plan"
        arguments = (builder, onnx_path, target, profiles, options, plan_path)
        built = run_isolated(_build_to_file, arguments, f"building {onnx_path.name} for {target}")
        if destination is None:
            return dataclasses.replace(built, plan=plan_path.read_bytes())
        os.chmod(plan_path, 0o666 & ~current_umask())
        os.replace(plan_path, destination)
        return dataclasses.replace(built, plan_path=destination)


def _build_to_file(
    builder: Builder, onnx_path: Path, target: str, profiles: list[Profile], options: BuildConfig, plan_path: Path
) -> BuiltEngine:
    """In the child: build, write the plan to `plan_path` (a pipe takes no large pickles), return the rest."""
    trt = import_builder(builder)  # what it prints itself goes to a file the parent logs (engines/child.py)
    return _build(trt, onnx_path, target, profiles, builder, options, plan_path)


def _build(
    trt: ModuleType,
    onnx_path: Path,
    target: str,
    profiles: list[Profile],
    builder: Builder,
    options: BuildConfig,
    plan_path: Path | None = None,
) -> BuiltEngine:
    """The build itself; with `plan_path`, TensorRT's serialized plan is written there from its own buffer (no
    bytes copy: a 3 GB plan would be held twice) and the record's `plan` is empty."""
    started = time.perf_counter()
    messages: list[tuple[trt_api.ILogger.Severity, str]] = []
    trt_logger = _logger(trt, messages)
    network_builder: trt_api.Builder = trt.Builder(trt_logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    timing_dir = options.timing_cache_dir.expanduser() if options.timing_cache_dir else None
    plan = None
    # the weights are the file's pages, let go of as the builder copies them (mapped_parse.py)
    with parsed_network(trt, network_builder, trt_logger, onnx_path, flags) as (network, weights):
        config = _builder_config(trt, network_builder, builder, target, options)
        cache = TimingCache(trt, config, builder, target, timing_dir)
        _add_profiles(trt, network_builder, network, config, profiles)
        with weights.shedding():
            if plan_path is not None and hasattr(network_builder, "build_serialized_network_to_stream"):
                built = build_to_stream(trt, network_builder, network, config, plan_path)
            else:
                plan = network_builder.build_serialized_network(network, config)
                built = plan is not None
        del network  # before the maps its weights point into are closed
    timing = cache.save()
    if not built:
        errors = [message for severity, message in messages if severity != trt.ILogger.WARNING]
        raise BuildError(
            f"TensorRT ({builder}) could not build {onnx_path.name} for {target}: "
            + ("; ".join(errors[-3:]) or "no error message"),
            hint="run with -vv for TensorRT's log",
        )
    if plan_path is not None and plan is not None:
        with plan_path.open("wb") as stream:
            stream.write(memoryview(plan))
    return BuiltEngine(
        plan=b"" if plan is None or plan_path is not None else bytes(plan),
        builder=builder,
        builder_version=str(trt.__version__),
        compute_capability=target,
        profiles=[p.as_record() for p in profiles],
        profile_names=[p.name for p in profiles if p.name],
        seconds=round(time.perf_counter() - started, 3),
        warnings=[message for severity, message in messages if severity == trt.ILogger.WARNING],
        timing_cache=timing,
    )


def _builder_config(
    trt: ModuleType, network_builder: trt_api.Builder, builder: Builder, target: str, options: BuildConfig
) -> trt_api.IBuilderConfig:
    """The builder config of `options` for `target` (TensorRT for RTX: its compute capability)."""
    config = network_builder.create_builder_config()
    if builder == "tensorrt-rtx":
        rtx_config = cast("RtxBuilderConfig", config)  # tensorrt_rtx's builder config: its own settings too
        rtx_config.num_compute_capabilities = 1
        rtx_config.set_compute_capability(getattr(trt.ComputeCapability, str(get_target(target).rtx_capability)), 0)
    if options.optimization_level is not None:
        config.builder_optimization_level = options.optimization_level
    if options.workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    config.hardware_compatibility_level = getattr(
        trt.HardwareCompatibilityLevel, HARDWARE_COMPATIBILITY[options.hardware_compatibility]
    )
    if options.detailed_profiling:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    return config


def _add_profiles(
    trt: ModuleType,
    network_builder: trt_api.Builder,
    network: trt_api.INetworkDefinition,
    config: trt_api.IBuilderConfig,
    profiles: list[Profile],
) -> None:
    for profile in profiles:  # in order: the runtime selects them by index
        optimization_profile = network_builder.create_optimization_profile()
        for index in range(network.num_inputs):
            name = network.get_input(index).name
            if name not in profile.shapes:
                raise BuildError(f"no profile shapes for input '{name}'", hint="declare its dims in the config")
            low, best, high = (trt.Dims(shape) for shape in profile.shapes[name])
            optimization_profile.set_shape(name, low, best, high)
        config.add_optimization_profile(optimization_profile)
