"""`Artifact`: what a backend's `open_backend` is handed (runtime/backends.py): the artifact's directory and
manifest, its tensors and the device found."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tensorsmith.runtime.device import Device
from tensorsmith.runtime.errors import ArtifactError
from tensorsmith.runtime.manifest import Manifest, VariantRecord, verified_file
from tensorsmith.runtime.specs import TensorSpec

CPU_TARGET = "cpu"


@dataclass(frozen=True)
class Artifact:
    directory: Path
    manifest: Manifest
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    device: Device

    @property
    def static_cache(self) -> bool:
        """Whether its decoder updates a static KV cache in place (TensorScatter)."""
        generation = self.manifest.generation
        return generation is not None and generation.kv_cache == "static"

    def cpu_variant(self) -> tuple[Path, VariantRecord | None]:
        """The variant the manifest assigns to the cpu target (its record: the backend and session settings the
        compile measured), else the fp32 reference graph (a large decoder's GPU-only artifact leaves it out)."""
        for target in self.manifest.targets:
            if target.name == CPU_TARGET:
                variant = self.manifest.variant(target.variant)
                return verified_file(self.directory, variant.path, variant.sha256), variant
        if self.manifest.model is None:
            raise ArtifactError(
                f"{self.directory} has neither a cpu target nor the fp32 reference graph to run without its "
                "targets' GPUs (a large decoder's reference is left out)",
                hint="compile it again with --target cpu",
            )
        return verified_file(self.directory, self.manifest.model.path, self.manifest.model.sha256), None

    def cpu_record(self) -> VariantRecord | None:
        """The cpu target's variant record, unverified (None: no cpu target): what the compile recorded for it."""
        variant = next((t.variant for t in self.manifest.targets if t.name == CPU_TARGET), None)
        return self.manifest.variant(variant) if variant is not None else None

    def recorded_cpu_backend(self) -> str | None:
        """The backend the compile measured fastest for the cpu variant (None: no cpu target)."""
        record = self.cpu_record()
        return record.backend if record is not None else None
