"""Compare a compiled MiniLM artifact with PyTorch on the held-out sentences (used by `make demo`).

python -m tensorsmith.samples.minilm.parity build/minilm
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tensorsmith.core.metrics import relative_error
from tensorsmith.runtime import load
from tensorsmith.samples.minilm.model import build

SAMPLE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--feeds", type=Path, default=SAMPLE / "evaluation.npz")
    args = parser.parse_args()

    import torch

    with np.load(args.feeds) as archive:
        feeds = {name: archive[name] for name in archive.files}
    with load(args.artifact) as model:
        outputs = model.run(feeds)
        print(f"backend: {model.backend} (fallback: {model.fallback_reason})")
    with torch.inference_mode():
        expected = build()(*(torch.from_numpy(feeds[name]) for name in ("input_ids", "attention_mask")))
    for (name, actual), reference in zip(outputs.items(), expected, strict=True):
        error = relative_error(reference.numpy(), actual)
        print(f"{name}: shape {actual.shape}, max |difference| / max |PyTorch| = {error:.2e}")
    embeddings = outputs["sentence_embedding"]
    cosine = np.sum(embeddings * expected[1].numpy(), axis=1)
    print(f"sentence_embedding cosine vs PyTorch over {len(cosine)} held-out sentences: min {cosine.min():.6f}")


if __name__ == "__main__":
    main()
