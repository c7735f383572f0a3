"""The slots on ONNX Runtime's CPU provider, written in place: each present bound to its past's rows (a view of
the slot arrays, so TensorScatter writes into them, as runtime/onnxruntime_cache.py does for one request). A
recurrent layer's state is read whole by the step that replaces it, so it is never written in its own buffer: it
goes to a spare beside the slots and is copied back for the visible rows.

A binding per row range is made once and kept (a decode range grows and shrinks with the requests; a prefill
runs one slot), so a step rebinds only its token ids, positions and write indices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tensorsmith.runtime.kv_cache import CacheShape, present_of
from tensorsmith.runtime.onnxruntime_cache import run_bound
from tensorsmith.runtime.slots import SlotCache, SlotFeeds

if TYPE_CHECKING:
    import onnxruntime


class OnnxRuntimeSlotCache(SlotCache):
    def __init__(self, session: onnxruntime.InferenceSession, shape: CacheShape) -> None:
        super().__init__(self._unused_run, shape)
        self._session = session
        self._bindings: dict[tuple[int, int], onnxruntime.IOBinding] = {}
        self._spares = {name: np.zeros_like(self.cache[name]) for name in self.states}

    @staticmethod
    def _unused_run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise AssertionError("the bound session runs through its I/O binding")

    def _binding(self, rows: slice) -> onnxruntime.IOBinding:
        key = (rows.start or 0, rows.stop)
        if key not in self._bindings:
            import onnxruntime

            binding = self._session.io_binding()
            binding.bind_output("logits", "cpu")  # first: get_outputs()[0]
            for name, cache in self.cache.items():
                value = onnxruntime.OrtValue.ortvalue_from_numpy(cache[rows])  # a view: the slots' own memory
                binding.bind_ortvalue_input(name, value)
                if name in self._spares:  # a state: written beside, copied back after the step
                    value = onnxruntime.OrtValue.ortvalue_from_numpy(self._spares[name][rows])
                binding.bind_ortvalue_output(present_of(name), value)
            binding.bind_ortvalue_input("attention_mask", onnxruntime.OrtValue.ortvalue_from_numpy(self.mask[rows]))
            self._bindings[key] = binding
        return self._bindings[key]

    def _run_rows(self, feeds: SlotFeeds, visible: np.ndarray) -> np.ndarray:
        binding = self._binding(feeds.rows)
        for name, array in feeds.small(self.shape.layout.position_ids).items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        run_bound(self._session, binding, "a batched step")
        for name, spare in self._spares.items():
            rows = self.cache[name][feeds.rows]
            rows[visible] = spare[feeds.rows][visible]
        logits = binding.get_outputs()[0].numpy()
        return np.asarray(logits[:, -1, :])

    def close(self) -> None:
        for binding in self._bindings.values():
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
        self._bindings.clear()
