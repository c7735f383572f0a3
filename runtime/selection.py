"""`select_engine`: which engine of an artifact this device should run, or why none."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tensorsmith.runtime.device import NO_DEVICE, Device
from tensorsmith.runtime.errors import ArtifactError
from tensorsmith.runtime.manifest import Manifest, TargetRecord, verified_file


@dataclass(frozen=True)
class Selection:
    target: TargetRecord | None
    reason: str = ""  # why no engine was chosen
    path: Path | None = None


def select_engine(manifest: Manifest, device: Device, directory: Path) -> Selection:
    """The built engine whose compute capability is the device's, whose builder flavour is installed at the
    version that built it (engines are locked to it), and whose file is intact (sha256 checked here, before
    anything deserializes it). Depends only on its arguments and the files under `directory`."""
    if device.compute_capability is None:
        return Selection(None, device.reason or NO_DEVICE)
    generation = manifest.generation
    if generation is not None and generation.state_layers:  # engines build (checked with tensorrt-rtx); not run
        return Selection(
            None,
            f"layers {generation.state_layers} keep linear-attention states, which the TensorRT "
            "runtime does not carry between steps yet",
        )
    built = [t for t in manifest.targets if t.status == "built" and t.engine is not None]
    matching = [t for t in built if t.name == device.compute_capability]
    if not matching:
        names = [t.name for t in built]
        return Selection(None, f"no engine for {device.compute_capability} in the artifact (engines: {names})")
    reasons = []
    for target in matching:
        assert target.engine is not None
        installed = device.tensorrt.get(target.builder)
        if installed is None:
            reasons.append(f"the {target.name} engine needs {target.builder}, which is not installed")
            continue
        if installed != target.engine.builder_version:
            reasons.append(
                f"the {target.name} engine was built with {target.builder} {target.engine.builder_version}, "
                f"{installed} is installed (engines only load in the version that built them)"
            )
            continue
        try:
            path = verified_file(directory, target.engine.path, target.engine.sha256)
        except ArtifactError as err:
            reasons.append(f"the {target.name} engine: {err.message}")
            continue
        return Selection(target, path=path)
    return Selection(None, "; ".join(reasons))
