"""A variant measured against the fp32 reference on its evaluation feeds, a few rows at a time.

A decoder's evaluation outputs are its logits at every position: 21 windows of 128 tokens at SmolLM-135M's
vocabulary are 528 MB, and a run of every window at once held them in ONNX Runtime's buffers, again as the
returned arrays, and beside the reference's (at SmolLM-135M, 2 GB of the INT4 variants' 3.9 GB peak). Here the
variant runs a few rows at a time (core/sessions.run_in_rows) and each run is reduced to running figures
(core/metrics.RunningAccuracy, core/language.TokenFigures) before the next: only the reference is held whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.calibration.data import Feeds
from tensorsmith.core.language import TokenFigures, language_model_metrics, reference_figures
from tensorsmith.core.metrics import METRICS, Budget, RunningAccuracy, accuracy
from tensorsmith.core.sessions import NotByRow, Session, onnx_errors, open_session, run_in_rows, session_feeds
from tensorsmith.runtime.manifest import VariantRecord

Figures = dict[str, float]


@dataclass(frozen=True)
class Evaluation:
    """What a variant is measured on: held-out feeds, fp32's outputs on them, and the budget (if any)."""

    feeds: Feeds
    reference: list[np.ndarray]
    budget: Budget | None
    described: str  # the data, in words (precision.json, the manifest)
    tokens: np.ndarray | None = None  # a decoder's evaluation windows: language-model metrics too
    timing: Feeds | None = None  # what the cpu recipe is timed on, if not `feeds` (a decoder's: a decode step)


def row_bytes(outputs: list[np.ndarray]) -> int | None:
    """The outputs' bytes per row (axis 0), or None where an output has no rows of the same count."""
    rows = {len(array) if array.ndim else None for array in outputs}
    if len(rows) != 1 or None in rows:
        return None
    (count,) = rows
    return sum(array.nbytes for array in outputs) // max(1, int(count or 1))


def measure_variant(path: Path | onnx.ModelProto, evaluation: Evaluation) -> Figures:
    """measure_session on a session opened over `path` (a file, or a graph in memory)."""
    with onnx_errors(path):
        return measure_session(open_session(path), evaluation)


def measure_session(session: Session, evaluation: Evaluation) -> Figures:
    """The figures of a variant record's accuracy for `session` on `evaluation`: cosine, min-cosine, sqnr-db and
    max_relative_error of every output against the reference, a decoder's perplexity, perplexity-ratio and
    next-token-agreement, and the budget's metric where it is none of these."""
    reference, budget = evaluation.reference, evaluation.budget
    per_row = row_bytes(reference)
    # a user's metric is a function of whole outputs (and a language metric without text is refused by its own)
    custom = (
        budget is not None
        and budget.metric not in METRICS
        and not (budget.is_language and evaluation.tokens is not None)
    )
    if per_row is None or custom:
        return _whole(session, evaluation)
    running = RunningAccuracy(len(reference))
    text = TokenFigures(evaluation.tokens) if evaluation.tokens is not None else None
    try:
        for rows, outputs in run_in_rows(session, evaluation.feeds, per_row):
            running.add([array[rows] for array in reference], outputs)
            if text is not None:
                text.add(outputs[0])
    except NotByRow:
        return _whole(session, evaluation)
    figures = running.figures()
    if text is not None:
        assert evaluation.tokens is not None
        figures |= text.metrics(reference_figures(evaluation.tokens, reference[0]))
    if budget is not None and budget.metric not in figures:
        figures[budget.metric] = running.figure(budget.metric)
    return figures


def _whole(session: Session, evaluation: Evaluation) -> Figures:
    return whole_figures(evaluation, list(session.run(None, session_feeds(session, evaluation.feeds))))


def whole_figures(evaluation: Evaluation, outputs: list[np.ndarray]) -> Figures:
    """measure_session's figures from whole outputs already computed."""
    figures = accuracy(evaluation.reference, outputs)
    if evaluation.tokens is not None:
        text = TokenFigures(evaluation.tokens)
        text.add(outputs[0])
        figures |= text.metrics(reference_figures(evaluation.tokens, evaluation.reference[0]))
    if evaluation.budget is not None and evaluation.budget.metric not in figures:
        figures[evaluation.budget.metric] = evaluation.budget.measure(evaluation.reference, outputs)
    return figures


def with_text_metrics(record: VariantRecord, evaluation: Evaluation, outputs: list[np.ndarray]) -> VariantRecord:
    """`record` with perplexity, perplexity-ratio and next-token-agreement of `outputs` where the evaluation is text
    (the reference variant's, whose other figures are against the source)."""
    if evaluation.tokens is None:
        return record
    measured = language_model_metrics(evaluation.tokens, evaluation.reference[0], outputs[0])
    return record.model_copy(update={"accuracy": {**record.accuracy, **measured}, "evaluated_on": evaluation.described})


def token_figures(path: Path | onnx.ModelProto, feeds: dict[str, np.ndarray], tokens: np.ndarray) -> TokenFigures:
    """A decoder's TokenFigures on the windows `tokens` (its prefill `feeds`), its logits (the first output)
    computed a few rows at a time."""
    with onnx_errors(path):
        session = open_session(path)
        try:
            figures = TokenFigures(tokens)
            for _, outputs in run_in_rows(session, feeds):
                figures.add(outputs[0])
        except NotByRow:
            figures = TokenFigures(tokens)
            figures.add(session.run(None, session_feeds(session, feeds))[0])
    return figures
