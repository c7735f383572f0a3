"""The one error family of tensorsmith.

It lives in the runtime because the runtime ships alone and every other package may import it;
`tensorsmith.core.errors` adds the compiler's errors to the family.
"""

from __future__ import annotations

import re


class TensorsmithError(Exception):
    """Base of every error tensorsmith raises on purpose. `hint` says what to do about it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message


class RuntimeLoadError(TensorsmithError):
    """An artifact, engine or backend could not be loaded."""


class BackendUnavailable(RuntimeLoadError):
    """A backend cannot run this artifact here (no engine for the device, a package not installed, an op it
    lacks): `load()` tries the next one, or says why when this one was asked for."""


class ArtifactError(RuntimeLoadError):
    """An artifact directory or its manifest is missing, malformed or unsafe."""


class InferenceError(TensorsmithError):
    """A loaded model failed while running valid feeds (the backend's own error, wrapped)."""


class InputError(TensorsmithError, ValueError):
    """Arguments or feeds a loaded model cannot take (a generation setting out of range, a token id outside the
    vocabulary), found before anything runs. A ValueError too, as numpy and transformers raise for such."""


# ONNX Runtime's status prefix, and the path it names when a load fails (the caller names the model its own way)
_STATUS_PREFIX = re.compile(r"^\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*(Load model from .* failed:)?\s*")


def onnxruntime_reason(err: BaseException) -> str:
    """ONNX Runtime's error as one line, without its `[ONNXRuntimeError] : 10 : INVALID_GRAPH :` prefix (the
    rest names the node or input)."""
    text = str(err).strip()
    return _STATUS_PREFIX.sub("", text.splitlines()[0]) if text else type(err).__name__
