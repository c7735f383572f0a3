"""Early engine builds (compiler/early_engines.py) are taken only for the graph and profiles they were started
from; a build of another graph is set aside, its failure included. The compile that takes them for real is
tests/compiler/test_decoders.py's."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from tensorsmith.compiler import CompileConfig
from tensorsmith.compiler.early_engines import EarlyEngines, _Started
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.core.errors import BuildError

PROFILES = [Profile({"input_ids": ([1, 1], [1, 8], [2, 16])}, "prefill")]


def test_an_early_build_is_taken_only_for_its_own_graph(tmp_path: Path) -> None:
    config = CompileConfig.create({"source": str(tmp_path), "targets": ["cpu", "sm_86"]})
    failed: Future[object] = Future()
    failed.set_exception(BuildError("TensorRT could not build it"))
    with EarlyEngines(config, tmp_path, None) as early:
        early._started["sm_86"] = _Started("a" * 64, [p.as_record() for p in PROFILES], failed)
        assert early.take("sm_86", "b" * 64, PROFILES) is None  # another graph: its failure is not this one's
        assert early.take("sm_86", "a" * 64, PROFILES) is None  # taken once only
        early._started["sm_86"] = _Started("a" * 64, [p.as_record() for p in PROFILES], failed)
        with pytest.raises(BuildError, match="could not build"):
            early.take("sm_86", "a" * 64, PROFILES)
        other = [Profile({"input_ids": ([1, 1], [1, 4], [2, 16])}, "prefill")]
        early._started["sm_86"] = _Started("a" * 64, [p.as_record() for p in PROFILES], failed)
        assert early.take("sm_86", "a" * 64, other) is None  # the same graph, other profiles
    assert not (tmp_path / ".early-engines").exists()
