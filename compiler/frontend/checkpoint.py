"""Load weights into a module from safetensors or a weights-only torch checkpoint; never unpickle objects."""

from __future__ import annotations

import json
import logging
import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from tensorsmith.compiler.frontend.checkpoint_weights import SHARD_INDEX
from tensorsmith.core.errors import ConfigError, ExportError
from tensorsmith.core.importing import first_line

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_LIST_LIMIT = 8  # names shown in an error before "... and N more"
SAVE_TENSORS = "save a state_dict, torch.save(model.state_dict(), path), or use safetensors"
# safetensors' dtype codes a checkpoint may hold, by torch's names: float weights (loaded as float32) and the
# integer and bool buffers some models save (positions, masks). Anything else (8-bit and smaller: int8, uint8,
# float8, float4, ...) is a quantized checkpoint, refused by name before the export.
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
BUFFER_DTYPES = {
    "BOOL": "bool",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}
QUANTIZED_DTYPES = {
    "I8": "int8",  # dtypes, not precisions
    "U8": "uint8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
}
FLOAT_WEIGHTS = "tensorsmith reads float32, float16 and bfloat16 weights"
SAVE_FLOAT = "save the weights unquantized, e.g. after model.to(torch.bfloat16); --precision quantizes them"


def _unpickler_reason(err: Exception) -> str:
    """The weights-only unpickler's own reason (e.g. "Unsupported global: GLOBAL builtins.print"), without the
    advice around it."""
    text = str(err)
    _, _, after = text.partition("WeightsUnpickler error:")
    reason = next((line.strip() for line in after.splitlines() if line.strip()), "")
    return reason or "not a weights-only pickle"


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:_LIST_LIMIT])
    return shown + (f" … and {len(keys) - _LIST_LIMIT} more" if len(keys) > _LIST_LIMIT else "")


def safetensors_dtypes(path: Path) -> dict[str, str]:
    """Each tensor's safetensors dtype code, from the header only; a file that is not safetensors named."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as opened:
            return {name: opened.get_slice(name).get_dtype() for name in opened.keys()}  # noqa: SIM118 (not iterable)
    except (SafetensorError, OSError, ValueError) as err:
        raise ExportError(f"checkpoint {path} is not a valid safetensors file: {err}") from err


def check_safetensors_dtypes(path: Path, stored: frozenset[str] = frozenset()) -> None:
    """Refuse, naming the dtype and the file, a safetensors file whose tensors are not float weights or integer
    buffers (`stored`: a pre-quantized format's tensors, read by it); only its header is read."""
    codes = safetensors_dtypes(path)
    taken = {*FLOAT_DTYPES, *BUFFER_DTYPES}
    refused = sorted(name for name, code in codes.items() if code not in taken and name not in stored)
    if refused:
        dtype = codes[refused[0]]
        raise ExportError(
            f"checkpoint {path} holds {QUANTIZED_DTYPES.get(dtype, dtype)} tensors ({_names(refused)}); "
            f"{FLOAT_WEIGHTS}",
            hint=SAVE_FLOAT,
        )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors in `path`: `.safetensors`, or `.pt`/`.pth`/`.bin` via `torch.load(weights_only=True)`."""
    import torch

    if not path.is_file():
        raise ExportError(f"checkpoint {path} does not exist", hint="check --checkpoint or `checkpoint` in the TOML")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise ExportError(f"checkpoint {path} is not a valid safetensors file: {err}") from err
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on the pickle protocol: the refusal below says enough
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message suggests weights_only=False; a security refusal never relays that advice.
        raise ExportError(
            f"checkpoint {path} holds pickled objects other than tensors ({_unpickler_reason(err)}); tensorsmith "
            "loads tensors only and refuses to unpickle anything else",
            hint=SAVE_TENSORS,
        ) from err
    except Exception as err:  # RuntimeError, EOFError, OSError... for a truncated or foreign file
        raise ExportError(
            f"checkpoint {path} is not a readable torch checkpoint ({type(err).__name__})", hint=SAVE_TENSORS
        ) from err
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # the common {"state_dict": ..., "epoch": ...} training checkpoint
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ExportError(
            f"checkpoint {path} holds a {type(loaded).__name__}, not a state_dict of tensors",
            hint="save model.state_dict() rather than the model object",
        )
    return loaded


def load_checkpoint(module: torch.nn.Module, path: Path) -> None:
    """Load `path` into `module`, strictly: missing, unexpected and mis-shaped keys are errors, named, and so is a
    float weight the checkpoint holds quantized; float16 and bfloat16 tensors load cast to the module's dtype."""
    import torch

    state = read_state_dict(path)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [
        f"{key} {tuple(state[key].shape)} vs {tuple(expected[key].shape)}"
        for key in sorted(set(state) & set(expected))
        if state[key].shape != expected[key].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_names(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches (checkpoint vs model): {_names(mismatched)}")
    if problems:
        raise ExportError(
            f"checkpoint {path} does not fit {type(module).__name__}: {'; '.join(problems)}",
            hint="check that the factory builds the same architecture the checkpoint was saved from",
        )
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    quantized = [
        f"{key} as {str(state[key].dtype).removeprefix('torch.')}"
        for key in sorted(state)
        if expected[key].is_floating_point() and state[key].dtype not in floats
    ]
    if quantized:
        raise ExportError(
            f"checkpoint {path} holds float weights quantized ({_names(quantized)}); {FLOAT_WEIGHTS}", hint=SAVE_FLOAT
        )
    module.load_state_dict(state, strict=True)
    logger.info("loaded %d tensors from %s", len(state), path)


def check_shards(directory: Path) -> None:
    """A sharded checkpoint's index names only files that are there, and each of them holds the tensors the index
    says: a shard missing or cut short is named before any work (transformers would report missing keys, or the
    kernel a bus error, minutes later)."""
    from safetensors import SafetensorError, safe_open

    index = directory / SHARD_INDEX
    if not index.is_file():
        return
    try:
        owner = json.loads(index.read_text())["weight_map"]
        expected: dict[str, set[str]] = {}
        for tensor, file in owner.items():
            expected.setdefault(str(file), set()).add(str(tensor))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"{index} is not a safetensors index ({first_line(err)})", hint="re-save the model with save_pretrained"
        ) from err
    for file, tensors in sorted(expected.items()):
        path = directory / file
        if not path.is_file():
            raise ConfigError(
                f"{index} names {file} for {len(tensors)} tensors, and {path} does not exist",
                hint="copy every shard of the checkpoint (the index lists them)",
            )
        try:
            with safe_open(str(path), framework="numpy") as opened:
                missing = sorted(tensors - set(opened.keys()))
        except (SafetensorError, OSError) as err:
            raise ConfigError(
                f"checkpoint shard {path} is truncated or damaged ({first_line(err)})",
                hint="copy the shard again: its size must match its header",
            ) from err
        if missing:
            raise ConfigError(
                f"{index} places {missing[0]} in {file}, which does not hold it"
                + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""),
                hint="the index and the shards come from different saves: copy them again",
            )
