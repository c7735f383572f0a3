"""The errors of the compiler, passes and calibration: one family with the runtime's (`TensorsmithError`), each
carrying a hint."""

from __future__ import annotations

from tensorsmith.runtime.errors import ArtifactError, RuntimeLoadError, TensorsmithError


class ConfigError(TensorsmithError):
    """A config file, flag or input declaration is wrong."""


class UsageError(ConfigError):
    """A flag or config key that names nothing there is (an unknown key, target or choice): the command line's
    exit status 2, as click gives its own usage errors."""


class ExportError(TensorsmithError):
    """The source model could not be loaded or exported to ONNX."""


class PassError(TensorsmithError):
    """A graph pass failed."""


class VerificationError(TensorsmithError):
    """The compiled graph's outputs do not match the source model's."""


class CalibrationError(TensorsmithError):
    """Calibration data or statistics are unusable."""


class BuildError(TensorsmithError):
    """A TensorRT engine could not be built."""


__all__ = [
    "ArtifactError",
    "BuildError",
    "CalibrationError",
    "ConfigError",
    "ExportError",
    "PassError",
    "RuntimeLoadError",
    "TensorsmithError",
    "VerificationError",
]
