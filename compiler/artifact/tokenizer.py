"""The tokenizer files of a Hugging Face directory, copied into the artifact for the runtime and `generate`."""

from __future__ import annotations

import shutil
from pathlib import Path

from tensorsmith.compiler.frontend.model_directory import HuggingFaceModel
from tensorsmith.runtime.manifest import FileRecord, sha256_of

TOKENIZER_DIRECTORY = "tokenizer"  # in the artifact


def copy_tokenizer(model: HuggingFaceModel, directory: Path) -> list[FileRecord]:
    """Copy the tokenizer files into the artifact being written, for the runtime (and `generate`) to use."""
    files = model.tokenizer_files()
    if not files:
        return []
    (directory / TOKENIZER_DIRECTORY).mkdir()
    records = []
    for file in files:
        target = directory / TOKENIZER_DIRECTORY / file.name
        shutil.copyfile(file, target)
        records.append(FileRecord(path=f"{TOKENIZER_DIRECTORY}/{file.name}", sha256=sha256_of(target)))
    return records
