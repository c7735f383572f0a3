"""Engine builds started before the variants are measured.

A decoder's variant that only engines run (fp16 for the GPU targets) is final once it is written: measuring it
(accuracy, perplexity) and timing the cpu target's session only add records. So its generation graph is written
at once (compiler/variants/kv_cache.early_graph) and its engines are built beside those measurements, each in its
own process, as the engines stage builds them. A build takes about one core for its whole length (13 s at the
SmolLM-135M shape), which on two cores the measurements would otherwise leave idle.

The engines stage takes an early build only for the graph and profiles it was started from (the same sha256),
else builds as before. Early builds start only where the memory left holds them beside this process as large as
it has been (`records.builds_that_fit`, the engines stage's estimate).
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.engines.builder import BuiltEngine, build_engine
from tensorsmith.compiler.engines.profile import Profile
from tensorsmith.compiler.engines.profiles import decoder_profiles
from tensorsmith.compiler.engines.records import builds_that_fit, choose_builder, memory_factor
from tensorsmith.compiler.frontend.model_directory import HuggingFaceModel
from tensorsmith.compiler.variants.kv_cache import EarlyGraph, early_graph, static_layout
from tensorsmith.core.errors import BuildError
from tensorsmith.core.external_bytes import graph_bytes
from tensorsmith.core.ir import GraphIO
from tensorsmith.runtime.manifest import sha256_of

logger = logging.getLogger(__name__)

SCRATCH = ".early-engines"  # inside the artifact being written: graphs linked and plans moved out, then deleted


@dataclass(frozen=True)
class _Started:
    sha256: str
    profiles: list[dict[str, object]]
    build: Future[BuiltEngine]


class EarlyEngines:
    """The early graphs and builds of one compile; a context manager that waits for the builds still running (a
    build cannot be stopped halfway) and removes what was not taken."""

    def __init__(self, config: CompileConfig, directory: Path, model: HuggingFaceModel | None) -> None:
        self._config, self._model = config, model
        self._scratch = directory / SCRATCH
        self._io: GraphIO | None = None
        self._pool: ThreadPoolExecutor | None = None  # made with the first builds, as many workers as fit
        self._started: dict[str, _Started] = {}
        self.graphs: dict[str, EarlyGraph] = {}  # variant name → its generation graph, for kv_cache to link

    def __enter__(self) -> EarlyEngines:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self._scratch, ignore_errors=True)

    def fused(self, io: GraphIO) -> None:
        """The fused graph's inputs and outputs, which the generation graphs' layout derives from."""
        self._io = io

    def written(self, name: str, targets: list[str], path: Path) -> None:
        """Variant `name` (run by `targets`) is final at `path`: write its generation graph and start its engines,
        where both are known now and the memory holds them."""
        if self._model is None or self._io is None or not self._model.is_decoder:
            return
        graph = early_graph(path, targets, self._model, self._config, self._scratch / path.parent.name)
        if graph is None:
            return
        self.graphs[name] = graph
        builders = {}
        for target in targets:
            try:
                builders[target] = choose_builder(target, self._config.build.requested_builder)
            except BuildError:
                continue  # the engines stage records it
        if not builders:
            return
        # beside this process grown back to its peak so far (ru_maxrss: kilobytes on Linux)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        room = builds_that_fit(len(builders), graph_bytes(graph.path), memory_factor(builders.values()), peak)
        if room == 0:
            logger.info("engines for %s not started early: no memory for a build beside the measurements", name)
            return
        if self._pool is None:  # one build a core, as the engines stage runs them
            self._pool = ThreadPoolExecutor(max_workers=min(room, os.cpu_count() or 1), thread_name_prefix="early")
        layout = static_layout(self._config, self._io)
        sha256 = sha256_of(graph.path)
        for target, builder in builders.items():
            profiles = decoder_profiles(layout.inputs, layout.dims, target)
            plan = self._scratch / f"{target}.engine"
            build = self._pool.submit(
                build_engine, graph.path, target, profiles, builder, self._config.build, sha256, plan
            )
            self._started[target] = _Started(sha256, _records(profiles), build)
        logger.info(
            "building the %s engine%s from variant %s beside its measurements",
            ", ".join(builders),
            "s" if len(builders) > 1 else "",
            name,
        )

    def take(self, target: str, sha256: str, profiles: list[Profile]) -> BuiltEngine | None:
        """`target`'s early build (waited for) if it was started from this graph and these profiles, else None.
        Its BuildError is raised only then: a build of another graph says nothing of this one."""
        started = self._started.pop(target, None)
        if started is None:
            return None
        if started.sha256 != sha256 or started.profiles != _records(profiles):
            logger.info("%s: the early engine was built from another graph: built again", target)
            return None
        return started.build.result()


def _records(profiles: list[Profile]) -> list[dict[str, object]]:
    return [profile.as_record() for profile in profiles]
