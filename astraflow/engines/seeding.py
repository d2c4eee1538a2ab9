"""Seeded sampling whose draws do not depend on what is decoded beside a request.

A request with ``SamplingParams.seed`` gives each of its rows a key (a hash of the seed and the row's
index), and the row's t-th token is drawn with a uniform that is a hash of (key, t): counter-based, as
JAX's PRNG keys and vLLM's per-request seeds are. A row's draws then depend on its seed and its
position only, not on which rows share the batch, the order requests arrived in, or the engine's
batching, so the same weights give the same tokens whatever the load (the node seeds every episode
from the recipe's seed and the task: :mod:`astraflow.workflows.seeding`). Rows of unseeded requests
get keys drawn from the engine's generator.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.engines.base import SamplingParams

KEY_BITS = 63
"""Keys are non-negative 63-bit integers: an int64 tensor holds them, and vLLM takes them as seeds."""

_WRAP = 1 << 64
_GOLDEN = 0x9E3779B97F4A7C15 - _WRAP  # splitmix64's constants as signed int64
_M1 = 0xBF58476D1CE4E5B9 - _WRAP
_M2 = 0x94D049BB133111EB - _WRAP


def mix(*parts: int | str) -> int:
    """A stable 63-bit key from ``parts`` (the same on every machine and Python; ``hash`` is not)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - KEY_BITS)


def row_keys(params: SamplingParams, rows: int) -> list[int | None]:
    """Each row's key: ``params.row_seeds`` when set (a merged batch of requests), else derived from
    ``params.seed``; None for the rows of an unseeded request."""
    if params.row_seeds is not None:
        if len(params.row_seeds) != rows:
            raise ValueError(f"row_seeds has {len(params.row_seeds)} keys for {rows} prompts")
        return list(params.row_seeds)
    if params.seed is None:
        return [None] * rows
    return [mix(params.seed, i) for i in range(rows)]


def fill_keys(keys: list[int | None], generator: Any) -> list[int]:
    """``keys`` with each None replaced by a key drawn from ``generator`` (a torch.Generator)."""
    import torch

    missing = sum(k is None for k in keys)
    if not missing:
        return keys  # type: ignore[return-value]
    drawn = iter(torch.randint(0, 1 << 62, (missing,), generator=generator, device=generator.device).tolist())
    return [next(drawn) if k is None else k for k in keys]


def _shr(z: Any, s: int) -> Any:
    """Logical right shift of int64 ``z`` (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _splitmix64(z: Any) -> Any:
    """splitmix64's finaliser over int64 tensors (products wrap modulo 2**64, as in C)."""
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def counter_uniforms(keys: Any, steps: Any, dtype: Any) -> Any:
    """One uniform in [0, 1) per row: a hash of (``keys[i]``, ``steps[i]``), int64 tensors on one device."""
    import torch

    bits = _shr(_splitmix64(_splitmix64(keys) + steps), 11)  # 53 bits
    return (bits.to(torch.float64) * 2.0 ** -53).to(dtype)
