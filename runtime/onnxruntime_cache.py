"""The static KV cache on ONNX Runtime: every present bound to its past's buffer (I/O binding), so TensorScatter
writes the step in place (ONNX Runtime checks that the two share an address, and otherwise copies the whole
past into a new present and logs "in-place optimization not activated"). A linear-attention layer's states are
two buffers each, the step reading one and writing the other, swapped after it.

The caches, the mask and the logits are bound once per request; a step rebinds only its new token ids,
positions and write indices. With the CUDA provider the caches are device tensors (OrtValues on "cuda") and only
those small inputs cross the bus, with the last position's logits coming back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tensorsmith.runtime.errors import InferenceError, onnxruntime_reason
from tensorsmith.runtime.kv_cache import CacheShape, StaticCacheSession, present_of

if TYPE_CHECKING:
    import onnxruntime


def run_bound(session: onnxruntime.InferenceSession, binding: onnxruntime.IOBinding, what: str) -> None:
    """Run `session` on its I/O binding; ONNX Runtime's error as an InferenceError naming `what` ran."""
    try:
        session.run_with_iobinding(binding)
    except Exception as err:  # onnxruntime's own untyped errors
        raise InferenceError(f"ONNX Runtime failed running {what}: {onnxruntime_reason(err)}") from err


class OnnxRuntimeStaticCache(StaticCacheSession):
    def __init__(
        self,
        session: onnxruntime.InferenceSession,
        shape: CacheShape,
        vocabulary: int,
        logits_dtype: np.dtype,
        device: str = "cpu",
    ) -> None:
        super().__init__(self._unused_run, shape)
        import onnxruntime

        self._session = session
        self._device = device
        self._binding = session.io_binding()
        self._values: dict[str, onnxruntime.OrtValue] = {}
        growing = set(shape.growing_pasts)
        # a state's next value is computed from all of its last (a Scan's carry): never in its own buffer, but
        # in a second one, the two swapped after each step
        self._spares: dict[str, tuple[np.ndarray, onnxruntime.OrtValue]] = {}
        for name, array in self.cache.items():
            value = onnxruntime.OrtValue.ortvalue_from_numpy(array, device, 0)  # on the cpu: the array itself
            self._values[name] = value
            self._binding.bind_ortvalue_input(name, value)
            if name in growing:
                self._binding.bind_ortvalue_output(present_of(name), value)  # the same buffer: written in place
                continue
            spare = np.zeros_like(array)
            self._spares[name] = (spare, onnxruntime.OrtValue.ortvalue_from_numpy(spare, device, 0))
            self._binding.bind_ortvalue_output(present_of(name), self._spares[name][1])
        # the host mask's own memory: the columns each step writes into it are what the next run reads
        self._binding.bind_ortvalue_input("attention_mask", onnxruntime.OrtValue.ortvalue_from_numpy(self.mask))
        self.logits = np.zeros((shape.rows, 1, vocabulary), logits_dtype)
        self._binding.bind_ortvalue_output("logits", onnxruntime.OrtValue.ortvalue_from_numpy(self.logits))

    @staticmethod
    def _unused_run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise AssertionError("the bound session runs through its I/O binding")

    def _run_step(self, small: dict[str, np.ndarray]) -> np.ndarray:
        for name, array in small.items():
            self._binding.bind_cpu_input(name, np.ascontiguousarray(array))
        run_bound(self._session, self._binding, "a generation step")
        for name, (spare, value) in list(self._spares.items()):  # the new states become the next step's input
            self._spares[name] = (self.cache[name], self._values[name])
            self.cache[name], self._values[name] = spare, value
            self._binding.bind_ortvalue_input(name, value)
            self._binding.bind_ortvalue_output(present_of(name), self._spares[name][1])
        return self.logits[:, -1, :]

    def reorder(self, origin: np.ndarray) -> None:
        if self._device == "cpu":
            super().reorder(origin)  # the OrtValues share the numpy arrays
            return
        self.mask[...] = self.mask[origin]
        for value in self._values.values():  # device tensors: through the host (beam search only)
            value.update_inplace(value.numpy()[origin])

    def close(self) -> None:
        self._binding.clear_binding_inputs()
        self._binding.clear_binding_outputs()
