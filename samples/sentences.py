"""Real English sentences that ship with CPython: the help topics of `pydoc_data.topics`."""

from __future__ import annotations

import re


def sentences(minimum_words: int = 6, maximum_words: int = 40) -> list[str]:
    """Distinct prose sentences, in a stable order (code samples and tables filtered out)."""
    from pydoc_data.topics import topics

    seen: set[str] = set()
    found = []
    for key in sorted(topics):
        text = re.sub(r"\s+", " ", topics[key])
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            words = sentence.split()
            if not minimum_words <= len(words) <= maximum_words:
                continue
            if not sentence[0].isupper() or re.search(r"[{}<>=|*\[\]]|\.\.\.|>>>", sentence):
                continue
            if sentence not in seen:
                seen.add(sentence)
                found.append(sentence)
    return found
