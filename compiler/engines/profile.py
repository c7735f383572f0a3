"""One optimization profile's shapes: what an engine build's child process unpickles (compiler/engines/
profiles.py makes them from the declared dims, and imports the compiler's configuration to do so)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Shapes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass
class Profile:
    """One optimization profile: (min, opt, max) shapes per input; a decoder's have names (prefill, decode)."""

    shapes: dict[str, Shapes]
    name: str = ""

    def as_record(self) -> dict[str, object]:
        return {name: {"min": s[0], "opt": s[1], "max": s[2]} for name, s in self.shapes.items()}


def as_profiles(profiles: Profile | Sequence[Profile]) -> list[Profile]:
    return [profiles] if isinstance(profiles, Profile) else list(profiles)
