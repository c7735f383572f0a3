"""Write the samples' data: seeded checkpoints and MiniLM's calibration/evaluation feeds.

    python -m tensorsmith.samples.prepare            # all samples
    python -m tensorsmith.samples.prepare tiny_bert  # one

Deterministic: running it twice writes the same bytes, and files already present are left alone.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tensorsmith.samples.cnn import model as cnn
from tensorsmith.samples.minilm.model import tokenizer
from tensorsmith.samples.sentences import sentences
from tensorsmith.samples.tiny_bert import model as tiny_bert

logger = logging.getLogger(__name__)

SAMPLES = Path(__file__).resolve().parent
CALIBRATION_SENTENCES = 128
EVALUATION_SENTENCES = 64


def prepare_tiny_bert(directory: Path) -> list[Path]:
    return [tiny_bert.write_weights(directory / "weights.safetensors")]


def prepare_cnn(directory: Path) -> list[Path]:
    return [cnn.write_weights(directory / "weights.pt")]


def encode(texts: list[str]) -> dict[str, np.ndarray]:
    encodings = tokenizer().encode_batch(texts)
    return {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
    }


def prepare_minilm(directory: Path) -> list[Path]:
    """Calibration and evaluation sets from disjoint sentences (evaluation is never calibrated on)."""
    texts = sentences()
    calibration = texts[:CALIBRATION_SENTENCES]
    evaluation = texts[CALIBRATION_SENTENCES : CALIBRATION_SENTENCES + EVALUATION_SENTENCES]
    written = []
    for name, subset in (("calibration.npz", calibration), ("evaluation.npz", evaluation)):
        path = directory / name
        arrays = encode(subset)
        np.savez(path, input_ids=arrays["input_ids"], attention_mask=arrays["attention_mask"])
        written.append(path)
    return written


def prepare_moe(directory: Path) -> list[Path]:
    return []  # seeded in its factory


PREPARERS: dict[str, Callable[[Path], list[Path]]] = {
    "tiny_bert": prepare_tiny_bert,
    "cnn": prepare_cnn,
    "minilm": prepare_minilm,
    "moe": prepare_moe,
}
OUTPUTS = {
    "tiny_bert": ["weights.safetensors"],
    "cnn": ["weights.pt"],
    "minilm": ["calibration.npz", "evaluation.npz"],
    "moe": [],
}


def prepare(name: str, force: bool = False) -> list[Path]:
    directory = SAMPLES / name
    expected = [directory / file for file in OUTPUTS[name]]
    if not force and all(path.is_file() for path in expected):
        return expected
    written = PREPARERS[name](directory)
    for path in written:
        logger.info("wrote %s", path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"samples to prepare: {list(PREPARERS)} (default: all)"
    )
    parser.add_argument("--force", action="store_true", help="rewrite files that already exist")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    unknown = sorted(set(args.names) - set(PREPARERS))
    if unknown:
        parser.error(f"unknown samples {unknown}; choose from {list(PREPARERS)}")
    for name in args.names or PREPARERS:
        prepare(name, force=args.force)


if __name__ == "__main__":
    main()
