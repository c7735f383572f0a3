"""Libraries that print their log lines on stdout log through Python's `logging` instead, for the whole process:
onnx-graphsurgeon (its G_LOGGER always prints) and Polygraphy (it prints unless told otherwise). stdout then
carries only what a command prints (`--json`: one object); the CLI shows these lines on stderr with -v."""

from __future__ import annotations

import logging

GRAPHSURGEON = "onnx_graphsurgeon"
POLYGRAPHY = "Polygraphy"  # the logger Polygraphy's python logging system writes to
LIBRARY_LOGGERS = (GRAPHSURGEON, POLYGRAPHY)


def route_graphsurgeon_logs() -> None:
    """onnx-graphsurgeon's G_LOGGER (one object that all its modules share) logs to `logging` under
    "onnx_graphsurgeon", at its own severities (its VERBOSE ones at DEBUG). Its severity still filters, as its
    `G_LOGGER.suppress()` blocks rely on, and a message it logs once is logged once."""
    from onnx_graphsurgeon.logger import G_LOGGER
    from onnx_graphsurgeon.logger.logger import LogMode

    target = logging.getLogger(GRAPHSURGEON)
    G_LOGGER.colors = False  # with colours, its first message is a warning that the `colored` module is missing

    def log(message: object, severity: int, mode: int = LogMode.EACH, stack_depth: int = 2) -> None:
        level = max(severity, logging.DEBUG)
        if severity < G_LOGGER.severity or not target.isEnabledFor(level):
            return
        if mode == LogMode.ONCE:
            if hash(message) in G_LOGGER.once_logged:
                return
            G_LOGGER.once_logged.add(hash(message))
        target.log(level, "%s", message() if callable(message) else message)

    G_LOGGER.log = log


def route_polygraphy_logs() -> None:
    """Polygraphy's G_LOGGER logs to `logging` under "Polygraphy", its warnings and errors only (its folding
    loop narrates every pass at INFO)."""
    from polygraphy.logger import G_LOGGER

    G_LOGGER.colors = False  # else it prints that the `colored` module is missing, with print()
    G_LOGGER.letter = False
    G_LOGGER.module_severity = G_LOGGER.WARNING
    G_LOGGER.use_python_logging_system = True
