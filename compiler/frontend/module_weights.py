"""A module's parameters bound to its checkpoint's tensors: built on the meta device, each parameter named after
its checkpoint tensor, loaded while its layer runs and released after (compiler/frontend/checkpoint_weights.py
reads the tensors)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.core.memory import trim_heap

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (buffers stay real: a rotary embedding's
    frequencies are computed as the module is built): nothing of the weights is allocated or initialized."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, parameter: torch.nn.Parameter | None) -> None:
        register(module, name, parameter)
        if parameter is not None and parameter.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(parameter.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def checkpoint_names(module: torch.nn.Module, weights: CheckpointWeights, prefix: str = "") -> dict[str, str] | None:
    """Each parameter and persistent buffer of `module` by its name in the module, the checkpoint's name of its
    tensor: its own (less `prefix`), or for a tied one (an output projection sharing the embedding table) the
    name of the tensor its first name has, as transformers ties them. None where some tensor has no name in the
    checkpoint, or one of another shape (a family whose loader renames or converts keys): such a module is loaded
    whole, as transformers loads it."""
    by_identity: dict[int, str] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        key = name.removeprefix(prefix)
        if id(tensor) not in by_identity and key in weights:
            if weights.shape(key) != tuple(tensor.shape):
                return None
            by_identity[id(tensor)] = key
    non_persistent = {
        f"{path}.{name}".lstrip(".")
        for path, child in module.named_modules()
        for name in getattr(child, "_non_persistent_buffers_set", ())
    }
    found: dict[str, str] = {}
    for name, tensor in named:
        if id(tensor) in by_identity:
            found[name] = by_identity[id(tensor)]
        elif name not in non_persistent:
            return None
    return found


def converts_keys(module: PreTrainedModel) -> bool:
    """Whether transformers converts some checkpoint tensors as it loads this model (a transpose, experts merged),
    beyond renaming them: such tensors cannot be read as stored."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # a transformers before 5: it converted nothing then
        return False
    return any(isinstance(transform, WeightConverter) for transform in get_model_conversion_mapping(module))


def empty_parameters(module: torch.nn.Module) -> None:
    """Replace `module`'s meta parameters by float32 tensors of their shapes whose memory is never touched (not
    resident until written), keeping tied parameters tied."""
    import torch

    replaced: dict[int, torch.nn.Parameter] = {}
    for child in module.modules():
        for name, parameter in list(child._parameters.items()):
            if parameter is None or parameter.device.type != "meta":
                continue
            if id(parameter) not in replaced:
                empty = torch.empty(parameter.shape, dtype=torch.float32)
                replaced[id(parameter)] = torch.nn.Parameter(empty, requires_grad=False)
            child._parameters[name] = replaced[id(parameter)]


def load_buffers(module: torch.nn.Module, weights: CheckpointWeights, names: dict[str, str]) -> None:
    """The persistent buffers the checkpoint holds, loaded for real (positions, masks: small)."""
    for path, buffer in list(module.named_buffers()):
        if path in names:
            owner, _, attribute = path.rpartition(".")
            child = module.get_submodule(owner)
            child.register_buffer(
                attribute,
                weights.tensor(names[path]).to(buffer.dtype),
                persistent=attribute not in child._non_persistent_buffers_set,
            )


def release_parameters(module: torch.nn.Module) -> None:
    """Every parameter emptied (after the export traced them): a read outside the hooks below fails, instead of
    computing with memory never written."""
    import torch

    for parameter in module.parameters():
        parameter.data = torch.empty(0)


@contextlib.contextmanager
def weights_while_running(module: torch.nn.Module, weights: CheckpointWeights, names: dict[str, str]) -> Iterator[None]:
    """While inside, each submodule with parameters of its own reads them from the checkpoint just before its
    forward runs and gives them back after: a forward of the whole module holds one module's weights at a time."""
    import torch

    def own(child: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, parameter) for name, parameter in child._parameters.items() if parameter is not None]

    paths = {id(parameter): name for name, parameter in module.named_parameters(remove_duplicate=False)}
    handles = []
    for child in module.modules():
        parameters = own(child)
        if not parameters:
            continue

        def load(
            _: torch.nn.Module, __: tuple[object, ...], parameters: list[tuple[str, torch.nn.Parameter]] = parameters
        ) -> None:
            for _name, parameter in parameters:
                parameter.data = weights.tensor(names[paths[id(parameter)]])

        def release(
            _: torch.nn.Module,
            __: tuple[object, ...],
            ___: object,
            parameters: list[tuple[str, torch.nn.Parameter]] = parameters,
        ) -> None:
            for _name, parameter in parameters:  # no placeholder of the full shape: freed memory it took would stay
                parameter.data = torch.empty(0)
            trim_heap()  # glibc keeps the freed weights' pages in its heap: 25 MB more a layer at hidden 1024

        handles += [child.register_forward_pre_hook(load), child.register_forward_hook(release)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
