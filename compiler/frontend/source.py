"""The source, opened before any work: an ONNX file is loaded and its inputs declared once, up front (the
file's own, with `--input` flags replacing any they name), and every dynamic dim gets its identifier, so that
every later stage (and the checks before them) reads one config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

import onnx

from tensorsmith.compiler.config import CompileConfig, InputDecl
from tensorsmith.compiler.declarations import DType
from tensorsmith.compiler.frontend.dims import declare_dims
from tensorsmith.compiler.frontend.huggingface import declare_model_inputs, read_model_directory
from tensorsmith.compiler.frontend.model_directory import HuggingFaceModel
from tensorsmith.compiler.frontend.mxfp4_weights import mxfp4_precision
from tensorsmith.compiler.frontend.quantized_checkpoint import checkpoint_float_precision, checkpoint_precision
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.ir import io_records, load_onnx, value_dims, value_record
from tensorsmith.core.precisions import AUTO, precision
from tensorsmith.core.quantization_declared import MXFP4_METHOD
from tensorsmith.runtime.manifest import TensorRecord


@dataclass(frozen=True)
class Source:
    config: CompileConfig  # inputs declared, dynamic dims named by identifiers
    onnx_model: onnx.ModelProto | None = None  # an ONNX source, loaded, with the declared dims applied
    huggingface: HuggingFaceModel | None = None  # a model directory, read (its module is built by the export)
    dim_names: dict[str, str] = field(default_factory=dict)  # identifier → the dim as the source wrote it
    default_dims: list[str] = field(default_factory=list)  # dynamic dims left to the default range

    @property
    def is_decoder(self) -> bool:
        return self.huggingface is not None and self.huggingface.is_decoder


def open_source(config: CompileConfig) -> Source:
    """Declare the inputs and name their dims; load an ONNX source and set them on its graph. PyTorch sources
    are exported later, by the export stage."""
    _check_source_path(config)
    directory = read_model_directory(config.resolve(config.source)) if config.source_kind == "huggingface" else None
    if directory is not None and directory.quantized is not None:
        config = checkpoint_precision(config, directory.quantized)
    if directory is not None and directory.declared_method == MXFP4_METHOD:
        config = mxfp4_precision(config)
    if directory is not None:
        config = checkpoint_float_precision(config, directory.directory)
    decoder = directory is not None and directory.is_decoder  # exported at opset 23 unless the config says
    floor = 0 if config.precision == AUTO else precision(config.precision).min_opset  # the request's graph form
    if config.opset < floor and not decoder:  # (a lower one given explicitly is refused by the config)
        config = config.model_copy(update={"opset": floor})
    if config.generation.model_fields_set and not (directory and directory.is_decoder):
        what = f"a {directory.architecture}" if directory else f"a {config.source_kind} source"
        raise ConfigError(
            f"[generation] is for decoders (a *ForCausalLM checkpoint directory); {config.source} is {what}",
            hint="remove [generation]; set the dims' ranges with [dims.NAME]",
        )
    _check_data_kinds(config, decoder)
    if directory is not None:
        declared = declare_dims(declare_model_inputs(config, directory))
        return Source(declared.config, None, directory, declared.names, declared.defaults)
    if config.source_kind != "onnx":
        declared = declare_dims(config)
        return Source(declared.config, None, None, declared.names, declared.defaults)
    origin = str(config.resolve(config.source))
    model = load_onnx(config.resolve(config.source))
    flags = {decl.name: decl for decl in config.inputs}
    records = io_records(model).inputs
    unknown = [name for name in flags if name not in {record.name for record in records}]
    if unknown:
        raise ConfigError(
            f"{origin} has no input '{unknown[0]}'", hint=f"its inputs are {[record.name for record in records]}"
        )
    shaped = {value.name for value in model.graph.input if value.type.tensor_type.HasField("shape")}
    decls = [flags.get(record.name) or _file_decl(record, record.name in shaped, origin) for record in records]
    declared = declare_dims(config.model_copy(update={"inputs": decls}))
    apply_input_decls(model, declared.config.inputs, origin)
    return Source(declared.config, model, None, declared.names, declared.defaults)


SOURCE_KINDS = "a Hugging Face model directory, an .onnx or .pt2 file, or a factory pkg.module:function"


def _check_source_path(config: CompileConfig) -> None:
    """A source that names no factory (no ':') is a path: one that is not there, or is none of the kinds, is said
    so first (else a missing directory reads as a factory whose inputs were not declared)."""
    kind = config.source_kind
    if kind == "huggingface" or (kind == "factory" and ":" in config.source):
        return
    path = config.resolve(config.source)
    if not path.exists():
        raise ConfigError(f"{path} does not exist", hint=f"check the SOURCE path: {SOURCE_KINDS}")
    if path.is_dir() and kind == "factory":
        raise ConfigError(f"{path} is a directory without config.json", hint=f"SOURCE is {SOURCE_KINDS}")
    if kind == "factory":
        raise ConfigError(f"{path} is not a source tensorsmith compiles", hint=f"SOURCE is {SOURCE_KINDS}")


def _check_data_kinds(config: CompileConfig, decoder: bool) -> None:
    """Calibration and evaluation data of a kind the source cannot take (text for an encoder, a .py for a decoder)
    fail here, named, before the export; not later in numpy's words. Missing paths are said by the readers."""
    if decoder:
        fits, takes = {".txt", ".npz"}, "a .txt file (read with its tokenizer) or an .npz of input_ids"
        hint = "pass FILE.txt or an .npz with input_ids [rows, length]"
    else:
        fits, takes = {".npz"}, "an .npz of arrays named after its inputs (samples on axis 0), or a folder of them"
        names = ", ".join(f"{decl.name}=…" for decl in config.inputs) or "INPUT=…"
        hint = f"save the samples with numpy.savez('FILE.npz', {names})"
    for what, path in (("calibration", config.calibration), ("evaluation", config.evaluation)):
        resolved = None if path is None else config.resolve(path)
        if resolved is None or not resolved.exists() or (resolved.is_dir() and not decoder):
            continue
        if resolved.is_file() and resolved.suffix in fits:
            continue
        kind = "a folder" if resolved.is_dir() else f"a {resolved.suffix or 'suffix-less'} file"
        source = f"the decoder {config.source}" if decoder else config.source
        raise ConfigError(f"{what} data {resolved} is {kind}; {source} takes {takes}", hint=hint)


def _file_decl(record: TensorRecord, shaped: bool, origin: str) -> InputDecl:
    """An input as the file declares it (a shape of no dims is a scalar; no shape at all is unknown rank)."""
    if record.dtype not in get_args(DType):
        hint = (
            "declare it with --input NAME:DTYPE:DIMS"
            if record.dtype == "unknown"
            else (f"tensorsmith compiles inputs of {', '.join(get_args(DType))}; cast it in the model")
        )
        raise ConfigError(f"input '{record.name}' of {origin} has dtype {record.dtype}", hint=hint)
    if not shaped:
        raise ConfigError(
            f"input '{record.name}' of {origin} has no shape (not even a rank)",
            hint=f"declare it with --input {record.name}:{record.dtype}:DIMS",
        )
    return InputDecl(name=record.name, dtype=record.dtype, dims=record.shape)


def apply_input_decls(model: onnx.ModelProto, decls: list[InputDecl], origin: str) -> None:
    """Set the declared dims (a name makes a dim dynamic) on an ONNX source's inputs; check names, dtypes, ranks.

    Shapes recorded downstream (value_info, outputs) were inferred from the old input shapes, so where these
    change they are cleared and inferred again by the canonicalize pass.
    """
    graph_inputs = {value.name: value for value in model.graph.input}
    changed = False
    for decl in decls:
        value = graph_inputs.get(decl.name)
        if value is None:
            raise ConfigError(
                f"{origin} has no input '{decl.name}'",
                hint=f"its inputs are {[r.name for r in io_records(model).inputs]}",
            )
        actual = value_record(value).dtype
        if actual != decl.dtype:
            raise ConfigError(
                f"input '{decl.name}' of {origin} is {actual}, declared {decl.dtype}",
                hint=f"declare it as {decl.name}:{actual}:…",
            )
        shape = value.type.tensor_type.shape
        if shape.dim and len(shape.dim) != len(decl.dims):
            raise ConfigError(
                f"input '{decl.name}' of {origin} has rank {len(shape.dim)}, declared {decl.describe()}",
                hint=f"its shape is {value_dims(value)}",
            )
        before = [(dim.dim_value, dim.dim_param) for dim in shape.dim]
        del shape.dim[:]
        for dim in decl.dims:
            entry = shape.dim.add()
            if isinstance(dim, int):
                entry.dim_value = dim
            else:
                entry.dim_param = dim
        changed = changed or before != [(dim.dim_value, dim.dim_param) for dim in shape.dim]
    if changed:
        del model.graph.value_info[:]
        for output in model.graph.output:
            output.type.tensor_type.ClearField("shape")
