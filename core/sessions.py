"""ONNX Runtime CPU sessions for the compiler's own work: running a graph for its outputs (core/timing.py times them).

Every session the compiler opens logs fatal messages only (ONNX Runtime's optimizer warnings are not the
user's business); onnxruntime is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Protocol

import numpy as np
import onnx

from tensorsmith.core.errors import ExportError
from tensorsmith.core.ir import inline_bytes, save_onnx
from tensorsmith.core.layerwise import LayerwiseSession, layerwise_segments
from tensorsmith.core.narrow_twin import TWIN_DISABLED_OPTIMIZERS, twin_of
from tensorsmith.runtime.errors import onnxruntime_reason

# ONNX Runtime's log severities run 0 verbose … 3 error, 4 fatal. The compiler's sessions log fatal only: an
# error comes back as an exception too, which the compiler words as one line (its log line would repeat it raw).
QUIET_SEVERITY = 4


class Runs(Protocol):
    """What timing asks of a session: ONNX Runtime's `run(names, feeds)` (the compiler's graphs output tensors)."""

    def run(self, names: Sequence[str] | None, feeds: dict[str, np.ndarray], /) -> list[np.ndarray]: ...


class NodeArg(Protocol):
    """A graph input or output as a session describes it: ONNX Runtime's NodeArg, core/layerwise.Argument."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> Sequence[int | str | None] | None: ...


class Session(Runs, Protocol):
    """What the compiler asks of a session over a graph: ONNX Runtime's InferenceSession, and
    core/layerwise.LayerwiseSession, which answers the same."""

    def get_inputs(self) -> Sequence[NodeArg]: ...

    def get_outputs(self) -> Sequence[NodeArg]: ...


def quiet_onnxruntime() -> ModuleType:
    """onnxruntime, with its process-wide default logger at error severity too: sessions that other libraries
    open for the compiler (onnxruntime.quantization's) log through it."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(QUIET_SEVERITY)
    return onnxruntime


def run_onnx(
    path: Path | onnx.ModelProto, feeds: dict[str, np.ndarray], origin: str | None = None, in_rows: bool = False
) -> list[np.ndarray]:
    """Outputs of the ONNX file at `path` (or of an in-memory graph) on ONNX Runtime's CPU provider, in graph
    order. `in_rows`: run a few rows at a time (run_in_rows) and join them, for outputs whose row is large (a
    decoder's logits at every position). An error names `origin` (what the file was made from), else the path."""
    with onnx_errors(path, origin):
        session = open_session(path)
        if in_rows:
            with contextlib.suppress(NotByRow):
                return _joined_rows(session, feeds)
        return owned(session.run(None, session_feeds(session, feeds)))


def owned(outputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """`outputs` as arrays that own their bytes. ONNX Runtime's output arrays are views into its session's arena,
    and one kept alive keeps the whole arena: at the 1B shape, verification's 9 MB of outputs held the twin
    session's 1.2 GB arena for the rest of the compile."""
    return [
        np.array(output) if isinstance(output, np.ndarray) and not output.flags.owndata else output
        for output in outputs
    ]


def _joined_rows(session: Session, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """run_in_rows' outputs written into arrays of every row as they come (joining the parts at the end held them
    twice: at the 1B shape, 8 evaluation windows' logits are 0.5 GB)."""
    rows = max((len(array) for array in session_feeds(session, feeds).values() if array.ndim), default=1)
    joined: list[np.ndarray] = []
    for part, outputs in run_in_rows(session, feeds):
        joined = joined or [np.empty((rows, *output.shape[1:]), output.dtype) for output in outputs]
        for whole, output in zip(joined, outputs, strict=True):
            if whole.shape[1:] != output.shape[1:]:  # a dynamic axis that differs between runs
                raise NotByRow(f"an output's shape {output.shape[1:]} changed from {whole.shape[1:]} between rows")
            whole[part] = output
    return joined


def open_session(path: Path | onnx.ModelProto) -> Session:
    """A quiet ONNX Runtime CPU session over the file at `path` (its narrow twin where one was written: the same
    outputs, the weights held in 16 bits; run a layer at a time where its weights are large: core/layerwise), or
    over an in-memory graph."""
    if isinstance(path, onnx.ModelProto):
        return session_for(path)
    onnxruntime = quiet_onnxruntime()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = QUIET_SEVERITY
    opened, disabled = measured_file(path)
    if (segment_bytes := layerwise_segments(opened)) is not None:
        return LayerwiseSession(opened, segment_bytes, disabled_optimizers=disabled, options=options)
    return onnxruntime.InferenceSession(
        str(opened), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
    )


def measured_file(path: Path) -> tuple[Path, list[str]]:
    """The file a session that measures the graph at `path` opens, and the optimizers it turns off: the graph's
    narrow twin (core/narrow_twin) where one is current, else the graph itself. Timing sessions open the graph.
    ONNX Runtime's CPU arena stays on for a twin: without it every run faults in fresh pages for the Casts'
    outputs (+30% a prefill at the 0.5B shape, for 0.1 GB less at the peak)."""
    twin = twin_of(path)
    return (twin, list(TWIN_DISABLED_OPTIMIZERS)) if twin is not None else (path, [])


@contextlib.contextmanager
def onnx_errors(path: Path | onnx.ModelProto, origin: str | None = None) -> Iterator[None]:
    """ONNX Runtime's errors opening or running `path` as one ExportError naming `origin`, else the path."""
    try:
        yield
    except Exception as err:  # onnxruntime's own exception types (Fail, InvalidGraph, NotImplemented, ...)
        if isinstance(err, ExportError):
            raise
        raise ExportError(
            f"ONNX Runtime cannot run {origin or ('a graph' if isinstance(path, onnx.ModelProto) else path)}: "
            f"{onnxruntime_reason(err)}",
            hint="every op must be one ONNX Runtime implements; `tensorsmith inspect FILE` lists them",
        ) from err


def session_feeds(session: Session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds `session` takes (an evaluation's may hold inputs only some graphs have)."""
    names = {value.name for value in session.get_inputs()}
    return {name: array for name, array in feeds.items() if name in names}


# Output bytes one run of a few rows of an evaluation may make: a decoder's evaluation outputs are its logits at
# every position (21 windows of 128 tokens at SmolLM-135M's vocabulary: 528 MB), which a run of all rows at once
# holds in ONNX Runtime's buffers and again as the returned arrays.
RUN_BYTES = 64 << 20


class NotByRow(Exception):
    """An output whose axis 0 is not the feeds' rows: the feeds must run whole."""


def run_in_rows(
    session: Session, feeds: dict[str, np.ndarray], row_bytes: int | None = None
) -> Iterator[tuple[slice, list[np.ndarray]]]:
    """`session`'s outputs on `feeds` a few rows (axis 0) at a time, with the rows each run covers: about RUN_BYTES
    of output a run, for outputs of `row_bytes` a row (None: as the first row, run alone, makes). Feeds whose axis
    0 is not the rows' go whole to every run; an output that is not by row raises NotByRow."""
    feeds = session_feeds(session, feeds)
    rows = max((len(array) for array in feeds.values() if array.ndim), default=1)
    if isinstance(session, LayerwiseSession):  # each run reads every weight again: one run of every row
        yield slice(0, rows), session.run(None, feeds)
        return
    declared = [*(value for value in session.get_inputs() if value.name in feeds), *session.get_outputs()]
    if any(value.shape is not None and (not value.shape or isinstance(value.shape[0], int)) for value in declared):
        raise NotByRow("a scalar, or a fixed axis 0, among the graph's inputs and outputs")  # an unknown one: tried
    start = 0
    while start < rows:
        part = slice(start, min(rows, start + (1 if row_bytes is None else max(1, RUN_BYTES // max(1, row_bytes)))))
        try:
            outputs = list(
                session.run(
                    None,
                    {
                        name: array[part] if array.ndim and len(array) == rows else array
                        for name, array in feeds.items()
                    },
                )
            )
        except Exception as err:  # ONNX Runtime's: one run of every row says what is wrong, if anything
            raise NotByRow(f"rows {part.start}-{part.stop} did not run alone") from err
        if any(output.ndim == 0 or len(output) != part.stop - part.start for output in outputs):
            raise NotByRow(f"an output of {len(outputs)} does not have the {part.stop - part.start} rows it was fed")
        row_bytes = row_bytes or sum(output.nbytes for output in outputs)
        start = part.stop
        yield part, outputs


def session_for(model: onnx.ModelProto, providers: Sequence[str] = ("CPUExecutionProvider",)) -> Session:
    """A quiet ONNX Runtime session over an in-memory graph (a search's switched graph, an observer's): opened from
    its bytes when small, else from a temporary file with its weights as external data (faster than protobuf's
    serialisation above EXTERNAL_DATA_ABOVE, and the only way over 2 GB); `model` is left as it was. ONNX
    Runtime's own errors propagate."""
    onnxruntime = quiet_onnxruntime()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = QUIET_SEVERITY
    if (data := inline_bytes(model)) is not None:
        return onnxruntime.InferenceSession(data, options, providers=list(providers))
    with tempfile.TemporaryDirectory(prefix="tensorsmith-session-") as scratch:
        path = Path(scratch) / "model.onnx"
        save_onnx(model, path)
        return onnxruntime.InferenceSession(str(path), options, providers=list(providers))


def session_with_outputs(
    path: Path, outputs: Sequence[str], providers: Sequence[str] = ("CPUExecutionProvider",)
) -> Session:
    """A quiet ONNX Runtime session over the graph saved at `path` that also returns `outputs` (tensors inside
    it). Its structure, with the outputs added, is written beside it for the session to open and then removed:
    the weights are read from the graph's own file, never copied into a protobuf. ONNX Runtime's errors propagate."""
    onnxruntime = quiet_onnxruntime()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = QUIET_SEVERITY
    opened, disabled = measured_file(path)
    if (segment_bytes := layerwise_segments(opened)) is not None:
        session: Session = LayerwiseSession(opened, segment_bytes, outputs, disabled, options)
        _SESSIONS_OVER[str(path.resolve())] = session
        return session
    structure = onnx.load(str(opened), load_external_data=False)
    present = {output.name for output in structure.graph.output}
    structure.graph.output.extend(onnx.ValueInfoProto(name=name) for name in outputs if name not in present)
    # beside the graph, where its external data's relative locations resolve (ONNX Runtime refuses absolute ones)
    with tempfile.NamedTemporaryFile(dir=opened.parent, prefix=f".{opened.stem}-observed-", suffix=".onnx") as written:
        written.write(structure.SerializeToString())
        written.flush()
        session = onnxruntime.InferenceSession(
            written.name, options, providers=list(providers), disabled_optimizers=disabled
        )
    _SESSIONS_OVER[str(path.resolve())] = session
    return session


# Sessions this process holds over a saved graph, by its path, while something holds them: a second fp32 session
# over the same 1B graph is 6 GB more (AWQ's observer and the decoder feeds' prefill run at once).
_SESSIONS_OVER: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()


# The last run a borrower made on an observer's session: (the session, its feeds, every output by name). A
# decoder's calibration feeds run each prefill for its cache, and the observer would run the same feeds again for
# its tensors: it takes this run instead (AWQ's statistics pass ran every calibration prefill twice).
_LAST_RUN: list[tuple[weakref.ref[Session], dict[str, np.ndarray], dict[str, np.ndarray]]] = []


def run_remembered(session: Session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `session` on `feeds`, kept for one recall_run of the same feeds (the next one)."""
    names = [output.name for output in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, feeds), strict=True))
    _LAST_RUN[:] = [(weakref.ref(session), feeds, outputs)]
    return outputs


def recall_run(session: Session, feeds: dict[str, np.ndarray], names: Sequence[str]) -> list[np.ndarray] | None:
    """`names`' values from the run_remembered on this very `session` with these feeds (compared by value:
    batching re-wraps them), else None; forgotten once asked."""
    if not _LAST_RUN:
        return None
    (owner, given, outputs), _LAST_RUN[:] = _LAST_RUN[0], []
    if owner() is not session or given.keys() != feeds.keys() or not all(name in outputs for name in names):
        return None
    if not all(np.array_equal(given[name], feeds[name]) for name in given):
        return None
    return [outputs[name] for name in names]


def session_over(path: Path) -> Session | None:
    """A session already open over the graph at `path` (session_with_outputs': every graph output among its
    outputs), or None. Borrow it for a run; do not keep it (it goes when its owner drops it)."""
    return _SESSIONS_OVER.get(str(path.resolve()))
