"""A Hugging Face model directory as a source: `config.json` and safetensors weights, as `save_pretrained` writes
them, optionally with tokenizer files. transformers builds the module from the local files only (nothing is
downloaded); the architecture in the config decides the task, and so the inputs and outputs:

- a decoder (`*ForCausalLM`, `*LMHeadModel`): text generation, with a KV cache (compiler/frontend/decoder.py);
- an encoder (`BertModel`, any `*Model`): feature extraction, `last_hidden_state` from `input_ids`,
  `attention_mask` (and `token_type_ids` where the model takes them);
- any other head (`*ForSequenceClassification`, `*ForMaskedLM`, …): its `logits`.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal, TypedDict

from tensorsmith.compiler.config import CompileConfig, DimRange, InputDecl
from tensorsmith.compiler.frontend.architecture_checks import check_architecture
from tensorsmith.compiler.frontend.checkpoint import FLOAT_WEIGHTS, SAVE_FLOAT, check_safetensors_dtypes, check_shards
from tensorsmith.compiler.frontend.checkpoint_weights import shard_owner
from tensorsmith.compiler.frontend.decoder import DIM_SUMS, declare_decoder, kv_cache_module
from tensorsmith.compiler.frontend.model_directory import HuggingFaceModel, is_decoder
from tensorsmith.compiler.frontend.quantized_checkpoint import read_quantized_checkpoint
from tensorsmith.compiler.frontend.routed_experts import register_routed_experts
from tensorsmith.core.errors import ConfigError, ExportError
from tensorsmith.core.importing import first_line

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
# the sizes compiler/frontend/decoder.py reads, under the names transformers' config classes all answer to
STANDARD_SIZES = ("num_hidden_layers", "num_attention_heads", "hidden_size", "num_key_value_heads")
# config.json's `dtype` (`torch_dtype` before transformers 4.56) that a checkpoint may give: the weights are loaded
# in float32 whichever it is (the reference and the fp32 graph are computed as transformers computes in float32)
CONFIG_DTYPES = ("float32", "float16", "bfloat16", "float64")


class LoadOptions(TypedDict, total=False):
    """The keyword arguments the export gives transformers' from_pretrained and _from_config."""

    dtype: torch.dtype
    torch_dtype: torch.dtype  # `dtype` before transformers 4.56
    attn_implementation: str
    experts_implementation: str
    use_kernels: bool


def is_model_directory(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_model_directory(path: Path) -> HuggingFaceModel:
    """The directory's config and architecture, checked before any work: weights present and safetensors."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(
            f"{path / CONFIG_FILE} is not readable JSON: {err}", hint="re-save it with save_pretrained"
        ) from err
    architectures = config.get("architectures") or []
    if not architectures:
        raise ConfigError(
            f"{path / CONFIG_FILE} names no architecture",
            hint='add "architectures": ["BertModel"] (the class save_pretrained was called on)',
        )
    if is_decoder(str(architectures[0])):
        config = _with_standard_sizes(config)
    model = HuggingFaceModel(path, str(architectures[0]), config)
    check_architecture(path, model.architecture, model.config)
    if not model.weights():
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        raise ConfigError(
            f"{path} has no .safetensors weights" + (f" (only {', '.join(pickled)})" if pickled else ""),
            hint="re-save the model with save_pretrained(dir, safe_serialization=True); pickled weights are not read",
        )
    check_shards(model.directory)
    model = replace(model, quantized=read_quantized_checkpoint(path, config))
    _check_dtypes(model)
    return model


def _with_standard_sizes(config: dict[str, object]) -> dict[str, object]:
    """config.json with the sizes the decoder layout reads under transformers' standard names, as the family's
    config class gives them: MPT's `n_layers`, XGLM's `attention_heads` and GPT-Neo's `num_layers` through its
    attribute map, and `num_key_value_heads` where the file has none (the heads its cache then holds: Falcon's new
    decoder architecture cached every head before transformers 5.25 and its num_kv_heads since)."""
    if not isinstance(config.get("model_type"), str) or all(key in config for key in STANDARD_SIZES):
        return config
    try:
        fields = {key: value for key, value in config.items() if key != "model_type"}
        built = _transformers().AutoConfig.for_model(config["model_type"], **fields)
    except Exception:  # no transformers, or a model type it does not know: the export says so, in its words
        return config
    sizes = {key: getattr(built, key, None) for key in STANDARD_SIZES if key not in config}
    return {**config, **{key: value for key, value in sizes.items() if isinstance(value, int)}}


def export_hint(model: HuggingFaceModel) -> str:
    """The hint of a directory's failed export: its inputs are tensorsmith's, not the user's to check."""
    version = _transformers().__version__
    return (
        f"run with -v for the exporters' tracebacks; tensorsmith declares a {model.architecture}'s inputs "
        f"itself: please report this with the tracebacks; transformers is {version}"
    )


def _check_dtypes(model: HuggingFaceModel) -> None:
    """A dtype the compile cannot take, in config.json or in a weights file, named before any work (a
    pre-quantized checkpoint's codes are its format's to read)."""
    for key in ("dtype", "torch_dtype"):
        declared = model.config.get(key)
        if declared is not None and declared not in CONFIG_DTYPES:
            raise ConfigError(
                f"{model.directory / CONFIG_FILE} gives {key} {declared!r}; {FLOAT_WEIGHTS}", hint=SAVE_FLOAT
            )
    stored = {part for parts in model.checkpoint_weights().stands_for().values() for part in parts}
    for path in model.weights():
        check_safetensors_dtypes(path, frozenset(stored))


def declare_model_inputs(config: CompileConfig, model: HuggingFaceModel) -> CompileConfig:
    """The inputs, output name and dims ranges the task implies, where the config does not give its own."""
    if model.is_decoder:
        return declare_decoder(config, model).model_copy(update={"dim_sums": config.dim_sums or DIM_SUMS})
    update: dict[str, object] = {}
    if not config.inputs:
        vocabulary = int(model.config.get("vocab_size") or 2)
        inputs = [
            InputDecl(name="input_ids", dtype="int64", dims=["batch", "sequence"], value_range=(0, vocabulary)),
            InputDecl(name="attention_mask", dtype="int64", dims=["batch", "sequence"]),
        ]
        if "token_type_ids" in _forward_parameters(model):
            inputs.append(InputDecl(name="token_type_ids", dtype="int64", dims=["batch", "sequence"]))
        update["inputs"] = inputs
    if not config.outputs:
        update["outputs"] = [model.output]
    if "sequence" not in config.dims and not config.inputs:
        update["dims"] = {**config.dims, "sequence": DimRange(max=model.max_sequence)}
    return config.model_copy(update=update)


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError as err:
        raise ExportError(
            "compiling a Hugging Face model directory needs transformers", hint="pip install 'tensorsmith[hf]'"
        ) from err
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def model_class(model: HuggingFaceModel) -> type[PreTrainedModel]:
    transformers = _transformers()
    cls = getattr(transformers, model.architecture, None)
    if cls is None:
        raise ExportError(
            f"transformers {transformers.__version__} has no class {model.architecture} "
            f"(from {model.directory / CONFIG_FILE})",
            hint="upgrade transformers, or compile a factory that builds the model",
        )
    return cls


def _forward_parameters(model: HuggingFaceModel) -> list[str]:
    return list(inspect.signature(model_class(model).forward).parameters)


def _dtype_argument(transformers: ModuleType) -> Literal["dtype", "torch_dtype"]:
    """from_pretrained's name for the dtype to load in: `dtype` from transformers 4.56, `torch_dtype` before (which
    later versions still take, with a deprecation warning)."""
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _no_hub_kernels(transformers: ModuleType) -> LoadOptions:
    """from_pretrained's `use_kernels=False`: from transformers 5.25 it swaps layers for kernels from the Hub by
    default, a download at run time (and an error where the `kernels` package is missing)."""
    return {"use_kernels": False} if int(transformers.__version__.split(".")[0]) >= 5 else {}


def _read_as_needed(model: HuggingFaceModel) -> dict[str, object]:
    """The checkpoint's tensors as safetensors slices that transformers reads one at a time, with pread: its own
    loader maps the files, and every mapped page it has read stays resident until the last tensor is loaded (at
    the Llama-3.2-1B shape, the 2.5 GB bf16 file on top of the 4.9 GB fp32 module)."""
    from safetensors import safe_open

    owner = shard_owner(model.directory)  # a sharded checkpoint's: which file holds each tensor
    slices: dict[str, object] = {}  # safetensors' slices, read by transformers as it reads tensors
    for path in model.weights():
        opened = safe_open(str(path), framework="pt", device="cpu", backend="pread")
        slices.update(
            (name, opened.get_slice(name))
            for name in opened.keys()  # noqa: SIM118 (not iterable)
            if owner is None or owner.get(name) == path.name
        )
    weights = model.checkpoint_weights()
    for name, stored in weights.stands_for().items():  # each quantized weight as its format's dequantization gives
        for part in stored:
            del slices[part]
        slices[name] = weights.tensor(name)
    return slices


def class_config(model: HuggingFaceModel, cls: type[PreTrainedModel]) -> PretrainedConfig:
    """config.json as `cls`'s config class reads it; a pre-quantized checkpoint's without its quantization (its
    weights arrive dequantized: no quantizer of transformers' to run)."""
    if cls.config_class is None:  # PreTrainedModel's own: every family's class names its config class
        raise ExportError(f"transformers' {cls.__name__} names no config class")
    config = cls.config_class.from_pretrained(str(model.directory), local_files_only=True)
    if model.declared_method is not None and hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def experts_option() -> LoadOptions:
    """Sparse experts computed as the routing chose them (compiler/frontend/routed_experts.py): every family whose
    stacked experts take transformers' experts kernels (Mixtral's `num_local_experts`, Qwen2-MoE's and OLMoE's
    `num_experts`, DeepSeek's `n_routed_experts`, …) gets it; a model without such experts ignores it."""
    return {"experts_implementation": register_routed_experts()}


def build_module(model: HuggingFaceModel, inputs: list[str], mla_cache: str = "latent") -> torch.nn.Module:
    """The model, loaded from the directory's safetensors only, in float32 whatever dtype the weights were saved
    in (transformers' default, the config's dtype, would make a bfloat16 checkpoint a bfloat16 module: fp32 inputs
    such as a decoder's past would not fit it, nor could its outputs be compared), returning its task's one
    output tensor. A decoder's latent attention caches as `mla_cache` says (compiler/frontend/latent_attention.py)."""
    import torch

    dtype = _dtype_argument(_transformers())
    options: LoadOptions = {"attn_implementation": "eager", **experts_option(), **_no_hub_kernels(_transformers())}
    options[dtype] = torch.float32
    cls = model_class(model)
    try:
        try:
            config = class_config(model, cls)
            loaded = cls.from_pretrained(None, config=config, state_dict=_read_as_needed(model), **options)
        except Exception as err:  # an older safetensors (no pread) or transformers (no lazy slices): its own reader
            if model.declared_method is not None:  # its loader would dequantize unchecked (MXFP4's NaN)
                raise
            logger.info("transformers reads %s with its own loader (%s)", model.directory, first_line(err))
            loaded = cls.from_pretrained(str(model.directory), local_files_only=True, use_safetensors=True, **options)
    except Exception as err:  # transformers raises OSError, ValueError, RuntimeError for a broken directory
        raise ExportError(f"transformers could not load {model.directory}: {str(err).strip().splitlines()[0]}") from err

    if model.is_decoder:
        return kv_cache_module(loaded, mla_cache)

    class TaskOutput(torch.nn.Module):
        """Keyword arguments to the model (its forward's order differs between families), one output back. Named
        parameters, not *args: torch.export's dynamic shapes follow the signature."""

        def __init__(self) -> None:
            super().__init__()
            self.model = loaded

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
        ) -> torch.Tensor:
            given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
            return self.model(**{name: given[name] for name in inputs}, return_dict=True)[model.output]

    return TaskOutput().eval()
