"""The artifact manifest (`OUT/manifest.json`): one schema, written by the compiler and read by the runtime."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tensorsmith.runtime.backends import ONNX_RUNTIME, CpuBackendName
from tensorsmith.runtime.errors import ArtifactError
from tensorsmith.runtime.specs import TensorSpec

# 2 added source.warnings, dim_names, default_dims, tokenizer and generation (all optional), and the source kind
# "huggingface"; version 1 manifests still read.
SCHEMA_VERSION = 3  # 3: a variant may be measured and not shipped; model may be null
READABLE_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorRecord(_Record):
    name: str
    dtype: str
    shape: list[int | str]

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, tuple(self.shape))


class SourceRecord(_Record):
    kind: Literal["factory", "exported_program", "onnx", "huggingface"]
    path: str = Field(description="factory 'pkg.module:function', or the file's path as given")
    sha256: str | None = Field(None, description="of the source file; of the checkpoint for a factory")
    checkpoint: str | None = None
    weights: str | None = Field(
        None, description="a checkpoint directory's weights as stored: 'bfloat16', or its quantized format"
    )
    exporter: Literal["dynamo", "torchscript", "none"] = "none"
    fallback_reason: str | None = Field(None, description="why the dynamo exporter was not used, if it was not")
    traced_layers: int | None = Field(
        None, description="a decoder's layers the export traced, the rest repeated from the last of them (None: all)"
    )
    opset: int
    warnings: list[str] = Field(default_factory=list, description="torch's and onnx's warnings during the export")


class PassRecord(_Record):
    name: str
    changed: bool
    counts: dict[str, int] = Field(default_factory=dict)
    seconds: float
    details: dict[str, object] = Field(default_factory=dict)
    variant: str = Field("", description="the variant whose file the pass wrote; empty: the compiled graph's")


class StepRecord(_Record):
    name: str
    seconds: float
    peak_rss_bytes: int | None = Field(None, description="the compiling process's peak resident memory in the step")


class FileRecord(_Record):
    path: str = Field(description="relative to the artifact directory")
    sha256: str


class VariantRecord(FileRecord):
    name: str
    precisions: list[str]
    accuracy: dict[str, float] = Field(default_factory=dict)
    evaluated_on: str = Field("", description="the data `accuracy` was measured on")
    backend: CpuBackendName = Field(
        ONNX_RUNTIME.name, description="what runs it on the cpu target: the backend the compile measured faster"
    )
    backend_latency_ms: dict[str, float] = Field(
        default_factory=dict, description="the cpu backends' median latency on the compile's timing batch"
    )
    onnxruntime_disabled_optimizers: list[str] = Field(
        default_factory=list, description="ONNX Runtime optimizers the compile measured slower here (CPU only)"
    )
    onnxruntime_session_config: dict[str, str] = Field(
        default_factory=dict,
        description="ONNX Runtime session config entries the compile chose by measurement (CPU only), e.g. "
        "session.qdq_matmulnbits_accuracy_level for an INT4 variant",
    )
    shipped: bool = Field(True, description="false: measured while compiling, not in the artifact (no target runs it)")


class EngineRecord(FileRecord):
    builder_version: str
    compute_capability: str
    profiles: list[dict[str, object]] = Field(default_factory=list)
    profile_names: list[str] = Field(default_factory=list, description="a decoder's: prefill, decode (in order)")
    cache: Literal["hit", "miss", "off"] = Field("off", description="hit: reused from the engine cache, not built")


class TargetRecord(_Record):
    name: str
    variant: str
    builder: Literal["none", "tensorrt", "tensorrt-rtx"]
    status: Literal["built", "pending", "failed", "not-needed"]
    reason: str = ""
    engine: EngineRecord | None = None


class GenerationRecord(_Record):
    """A decoder's KV cache layout, for the runtime's generate(): past_key_values.N.key|value in,
    present.N.key|value out, [batch, kv_heads, length, head_dim] each; a linear-attention layer's fixed-size
    states in their place (`state_layers`)."""

    layers: int
    kv_heads: int
    head_dim: int = Field(description="the keys' last dim")
    value_head_dim: int | None = Field(None, description="the values' last dim where it is not the keys'")
    cache_form: Literal["per_head", "latent", "latent_indexed"] = Field(
        "per_head",
        description="per_head: each kv head's keys and values; latent: multi-head latent attention's compressed "
        "cache (DeepSeek's MLA), one head of the normalised latent as the key and the rotary key as the value; "
        "latent_indexed: the same with DeepSeek-V3.2's indexer key after the rotary key in the value",
    )
    max_sequence_length: int = Field(description="prompt and new tokens together, at most")
    eos_token_id: list[int] = Field(default_factory=list)
    pad_token_id: int | None = None
    kv_cache: Literal["dynamic", "static"] = Field(
        "dynamic",
        description="static: caches of the request's length, written in place at write_indices, attention_mask "
        "[batch, cache] over the slots (passes/static_cache.py); dynamic: Optimum's and GenAI's growing cache",
    )
    kv_cache_reason: str = Field("", description="why the cache is dynamic when static was not asked against")
    layer_head_dims: dict[int, int] = Field(
        default_factory=dict, description="layers whose keys and values are another width (Gemma 4's global ones)"
    )
    position_ids: bool = Field(True, description="whether the graph reads position_ids (MPT's ALiBi does not)")
    state_layers: list[int] = Field(
        default_factory=list,
        description="layers that keep fixed-size states instead of keys and values (linear attention: "
        "past_key_values.N.conv and past_key_values.N.recurrent in, present.N.conv|recurrent out)",
    )
    state_shapes: dict[str, list[int]] = Field(
        default_factory=dict, description="each state's shape without the batch: conv, recurrent"
    )

    def last_dim(self, kind: str, layer: int | None = None) -> int:
        """The last dim of a layer's `kind` ("key" or "value") cache tensor."""
        if layer is not None and layer in self.layer_head_dims:
            return self.layer_head_dims[layer]
        return self.value_head_dim or self.head_dim if kind == "value" else self.head_dim

    def layer_tensors(self, layer: int) -> tuple[str, ...]:
        """What layer `layer` caches: its states' kinds, or key and value."""
        return tuple(self.state_shapes) if layer in self.state_layers else ("key", "value")

    @property
    def attention_layers(self) -> list[int]:
        return [layer for layer in range(self.layers) if layer not in self.state_layers]


class Manifest(_Record):
    schema_version: int = SCHEMA_VERSION
    tensorsmith_version: str
    source: SourceRecord
    model: FileRecord | None = Field(
        None,
        description="the fp32 reference graph; none where the cpu target runs another variant and no target runs it "
        "(measured while compiling, then left out: the artifact holds what its targets run)",
    )
    inputs: list[TensorRecord]
    outputs: list[TensorRecord]
    dims: dict[str, dict[str, int | None]] = Field(
        default_factory=dict, description="min/opt/max of the named dynamic dims, for engine profiles"
    )
    dim_names: dict[str, str] = Field(
        default_factory=dict, description="a dynamic dim's name here → as the source wrote it, where they differ"
    )
    default_dims: list[str] = Field(
        default_factory=list, description="dynamic dims without a declared range: engines used the default"
    )
    tokenizer: list[FileRecord] = Field(
        default_factory=list, description="the source directory's tokenizer files, copied (tokenizer/…)"
    )
    generation: GenerationRecord | None = Field(None, description="a decoder's KV cache, for generate()")
    steps: list[StepRecord] = Field(default_factory=list, description="the pipeline's stages and their times")
    passes: list[PassRecord] = Field(default_factory=list)
    variants: list[VariantRecord] = Field(default_factory=list)
    targets: list[TargetRecord] = Field(default_factory=list)

    def batch_dim(self) -> str | None:
        """The named dim every input and output starts with (the batch), if there is one."""
        firsts = {record.shape[0] if record.shape else None for record in [*self.inputs, *self.outputs]}
        first = firsts.pop() if len(firsts) == 1 else None
        return first if isinstance(first, str) else None

    def batch_limits(self, engine: EngineRecord | None = None) -> tuple[int | None, int | None]:
        """(the largest batch, the batch it was tuned for): `engine`'s optimization profile (max, opt of the first
        input's first dim) when it has one, else the declared [dims] max and opt of `batch_dim()`; (None, None)
        without a batch dim."""
        batch = self.batch_dim()
        if batch is None:
            return None, None
        if engine is not None and engine.profiles:
            profile = engine.profiles[0].get(self.inputs[0].name)
            if isinstance(profile, dict):
                return int(profile["max"][0]), int(profile["opt"][0])
        limits = self.dims.get(batch, {})
        return limits.get("max"), limits.get("opt")

    def variant(self, name: str) -> VariantRecord:
        for variant in self.variants:
            if variant.name == name:
                return variant
        known = [v.name for v in self.variants]
        raise ArtifactError(f"the manifest has no variant '{name}'", hint=f"variants are {known}")


def external_data_path(path: Path) -> Path:
    """Where an ONNX file saved at `path` keeps its weights when they are not inside it (core/ir.py save_onnx)."""
    return path.with_name(f"{path.name}.data")


def checkpoint_links_path(path: Path) -> Path:
    """The directory of checkpoint files the compiler's graph at `path` reads its weights from, hard-linked
    beside it (core/checkpoint_references.py); never part of an artifact."""
    return path.parent / f".{path.name}.checkpoint"


def sha256_of(path: Path) -> str:
    """Of the file's bytes, followed by those of its external data (`<name>.data` beside an ONNX file) if it has
    one: a record of a model covers its weights, and an engine cache key changes with them."""
    digest = hashlib.sha256()
    sidecar = external_data_path(path)
    # a graph whose weights are a checkpoint's files linked beside it (the compiler's fused graph) covers them too
    linked = checkpoint_links_path(path)
    parts = [path, *([sidecar] if sidecar.is_file() else []), *(sorted(linked.iterdir()) if linked.is_dir() else [])]
    for part in parts:
        with part.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def resolve_inside(directory: Path, relative: str) -> Path:
    """The path `relative` names under `directory`, refused if it escapes it (`..`, absolute, a symlink out)."""
    root = directory.resolve()
    candidate = (root / relative).resolve()
    if Path(relative).is_absolute() or not candidate.is_relative_to(root):
        raise ArtifactError(
            f"{directory / MANIFEST_NAME} names '{relative}', which is outside the artifact directory",
            hint="the manifest may have been tampered with; recompile the artifact",
        )
    return candidate


def verified_file(directory: Path, relative: str, sha256: str) -> Path:
    """The file the manifest names at `relative`, checked: inside `directory`, present, and with `sha256`."""
    path = resolve_inside(directory, relative)
    if not path.is_file():
        raise ArtifactError(f"{path} is missing", hint="the artifact is incomplete; recompile it")
    actual = sha256_of(path)
    if actual != sha256:
        raise ArtifactError(
            f"{path} does not match its sha256 (it has {actual[:12]}…, the manifest says {sha256[:12]}…)",
            hint="the file was changed after compiling; recompile the artifact",
        )
    return path


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(
            f"{path} does not exist",
            hint="pass the directory that `tensorsmith compile -o OUT` wrote",
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ArtifactError(f"{path} is not valid JSON: {err}", hint="recompile the artifact") from err
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version not in READABLE_VERSIONS:
        readable = " and ".join(str(v) for v in READABLE_VERSIONS)
        raise ArtifactError(
            f"{path} has schema_version {version!r}; this tensorsmith reads versions {readable}",
            hint="recompile the artifact with this tensorsmith, or install the version that wrote it",
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ArtifactError(f"{path}: field '{field}': {first['msg']}", hint="recompile the artifact") from err
