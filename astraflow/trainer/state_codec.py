"""Nested state (an optimizer's ``state_dict``) as safetensors + JSON, never pickle.

Why: a trainer resumes from objects in the bucket, and whoever can write to the bucket must not be
able to run code in the trainer. ``torch.save`` with a pickle-allowing ``torch.load`` is pickle, which
executes whatever a crafted object asks for. Here the tensors go into a safetensors blob (a JSON
header plus raw bytes: nothing to execute) and everything else — dict keys (an optimizer's are
ints), param groups, step counters, tuples such as ``betas`` — into a JSON skeleton that names each
tensor by a slot. Decoding accepts only this grammar and raises :class:`StateFormatError` on
anything else, so a pickle or a corrupt object is refused, not interpreted.

Skeleton grammar (JSON)::

    node := null | true | false | int | str | float | [node, ...]
          | {"$tensor": "<slot>"} | {"$tuple": [node, ...]}
          | {"$dict": [[key, node], ...]}          key := null | bool | int | float | str
          | {"$float": "nan" | "inf" | "-inf"}
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FORMAT = "astraflow-state/1"
_SCALARS = (type(None), bool, int, str)


class StateFormatError(ValueError):
    """The bytes are not a state written by :func:`encode_state` (or the state cannot be encoded)."""


def encode_state(state: Any) -> tuple[bytes, bytes]:
    """``(tensors, skeleton)``: a safetensors blob and a JSON document that together rebuild ``state``."""
    from safetensors.torch import save as st_save

    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()

    def put(t: torch.Tensor) -> dict[str, str]:
        slot = f"t{len(tensors)}"
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage and t.numel():  # safetensors refuses tensors that share memory
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        tensors[slot] = t
        return {"$tensor": slot}

    skeleton = {"format": FORMAT, "state": _encode(state, put, "state")}
    return st_save(tensors), json.dumps(skeleton, allow_nan=False, separators=(",", ":")).encode()


def decode_state(tensors_blob: bytes, skeleton_blob: bytes) -> Any:
    """The state :func:`encode_state` was given; :class:`StateFormatError` on any other input."""
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    try:
        skeleton = json.loads(skeleton_blob)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StateFormatError(f"state skeleton is not JSON: {exc}") from None
    if not isinstance(skeleton, dict) or skeleton.get("format") != FORMAT or "state" not in skeleton:
        raise StateFormatError(f"state skeleton is not an {FORMAT} document")
    try:
        tensors = st_load(tensors_blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:  # a corrupt or foreign object
        raise StateFormatError(f"state tensors are not a safetensors blob: {exc}") from None
    used: set[str] = set()
    state = _decode(skeleton["state"], tensors, used, "state")
    if used != set(tensors):
        raise StateFormatError(f"state tensors {sorted(set(tensors) - used)[:5]} are not referenced by the skeleton")
    return state


def encode_plain(state: Any) -> bytes:
    """A tensor-free state (optimizer param groups) as the JSON skeleton alone."""

    def refuse(_t: Any) -> dict[str, str]:
        raise StateFormatError("encode_plain: the state holds a tensor (use encode_state)")

    return json.dumps({"format": FORMAT, "state": _encode(state, refuse, "state")}, allow_nan=False,
                      separators=(",", ":")).encode()


def decode_plain(skeleton_blob: bytes) -> Any:
    """The state :func:`encode_plain` was given; :class:`StateFormatError` on any other input."""
    try:
        skeleton = json.loads(skeleton_blob)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StateFormatError(f"state skeleton is not JSON: {exc}") from None
    if not isinstance(skeleton, dict) or skeleton.get("format") != FORMAT or "state" not in skeleton:
        raise StateFormatError(f"state skeleton is not an {FORMAT} document")
    return _decode(skeleton["state"], {}, set(), "state")


def _encode(node: Any, put: Any, path: str) -> Any:
    import torch

    if isinstance(node, torch.Tensor):
        return put(node)
    if isinstance(node, float):
        return node if math.isfinite(node) else {"$float": repr(node)}
    if isinstance(node, _SCALARS):
        return node
    if isinstance(node, dict):
        items = []
        for k, v in node.items():
            if not isinstance(k, (*_SCALARS, float)):
                raise StateFormatError(f"{path}: dict key {k!r} of type {type(k).__name__} cannot be stored")
            items.append([k, _encode(v, put, f"{path}[{k!r}]")])
        return {"$dict": items}
    if isinstance(node, tuple):
        return {"$tuple": [_encode(v, put, f"{path}[{i}]") for i, v in enumerate(node)]}
    if isinstance(node, list):
        return [_encode(v, put, f"{path}[{i}]") for i, v in enumerate(node)]
    raise StateFormatError(f"{path}: a {type(node).__name__} cannot be stored (tensors, numbers, strings, "
                           f"lists, tuples and dicts only)")


def _decode(node: Any, tensors: dict[str, Any], used: set[str], path: str) -> Any:
    if isinstance(node, (*_SCALARS, float)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors, used, f"{path}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, dict) and len(node) == 1:
        (tag, body), = node.items()
        if tag == "$tensor" and isinstance(body, str) and body in tensors:
            used.add(body)
            return tensors[body]
        if tag == "$tuple" and isinstance(body, list):
            return tuple(_decode(v, tensors, used, f"{path}[{i}]") for i, v in enumerate(body))
        if tag == "$float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "$dict" and isinstance(body, list):
            out = {}
            for item in body:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (*_SCALARS, float))):
                    raise StateFormatError(f"{path}: malformed dict item {str(item)[:80]}")
                out[item[0]] = _decode(item[1], tensors, used, f"{path}[{item[0]!r}]")
            return out
    raise StateFormatError(f"{path}: unexpected node {str(node)[:80]}")
