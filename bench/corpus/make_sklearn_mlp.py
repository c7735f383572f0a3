"""Write tests/fixtures/corpus/sklearn_mlp_regressor.onnx: a scikit-learn MLPRegressor (8 → 32 → 16 → 1) converted
by skl2onnx, the ONNX corpus's file from a non-torch converter that ships no model of its own.

scikit-learn pulls in scipy (too large for the test environment), so the 4 KB file is committed and this script
only documents how it was made: `pip install scikit-learn skl2onnx==1.20.0 && python bench/corpus/make_sklearn_mlp.py`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from skl2onnx import convert_sklearn  # type: ignore[import-not-found]
from skl2onnx.common.data_types import FloatTensorType  # type: ignore[import-not-found]
from sklearn.neural_network import MLPRegressor  # type: ignore[import-not-found]

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "corpus" / "sklearn_mlp_regressor.onnx"


def main() -> None:
    rng = np.random.default_rng(0)
    features = rng.standard_normal((200, 8)).astype(np.float32)
    target = (features @ rng.standard_normal(8)).astype(np.float32)
    model = MLPRegressor(hidden_layer_sizes=(32, 16), max_iter=300, random_state=0).fit(features, target)
    # An int opset keeps to the ai.onnx domain (MatMul, Add, Relu); the batch dim is written unnamed.
    converted = convert_sklearn(model, initial_types=[("X", FloatTensorType([None, 8]))], target_opset=17)
    onnx.save(converted, str(OUT))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
