"""Trajectory tables decoded a column at a time: validation and ``min_version`` over Arrow arrays, and
:class:`LazyTrajectory`, whose token columns stay in Arrow until something reads them.

Why: decoding row by row (a dict per row, every token list built, ``validate`` per row) cost about
25 µs a trajectory — the whole budget of an offline replay, which reads none of the token lists (it
judges staleness by ``min_version``, groups by id and filters by reward). The decisions are
unchanged: a row is refused by :meth:`Trajectory.validate` itself, and ``min_version`` is the
property's own value whenever the lists were read (and so could have been changed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from astraflow.records.schema import map_to_dict
from astraflow.records.trajectory import FIELDS, Trajectory

LAZY = ("prompt_ids", "response_ids", "logprobs", "versions", "loss_mask", "rewards", "turn_bounds")
"""Fields left in Arrow until read (the per-token ones and the reward map)."""
EAGER = tuple(f.name for f in FIELDS if f.name not in LAZY)
_NAMES = tuple(f.name for f in FIELDS)
if tuple(f.name for f in dataclasses.fields(Trajectory)) != _NAMES:  # positional construction relies on it
    raise ImportError("Trajectory's fields are not in the order of trajectory.FIELDS")
_SLOTS = {name: Trajectory.__dict__[name] for name in _NAMES}
"""The dataclass's own slot descriptors, where a read lazy field is kept (Trajectory's memory layout)."""


def _lengths(col: pa.ChunkedArray) -> np.ndarray:
    """Entries per row of a list column (-1 for a null list)."""
    return pc.fill_null(pc.list_value_length(col), -1).to_numpy(zero_copy_only=False).astype(np.int64)


def _values(col: pa.ChunkedArray, null: int) -> np.ndarray:
    """The entries of a list column, row after row (null lists contribute none; null entries read ``null``)."""
    return pc.fill_null(pc.list_flatten(col.combine_chunks()), null).to_numpy(zero_copy_only=False)


def invalid_rows(table: pa.Table) -> np.ndarray:
    """Indices, in row order, of the rows :meth:`Trajectory.validate` may refuse (a null where it reads
    a value included: it fails there too). ``table`` is conformed to the trajectory schema."""
    n = _lengths(table.column("response_ids"))
    bad = pc.fill_null(pc.equal(pc.utf8_length(table.column("episode_id")), 0), True).to_numpy(zero_copy_only=False)
    bad = bad | (n < 0)
    for name in ("logprobs", "versions", "loss_mask"):
        bad = bad | (_lengths(table.column(name)) != n)
    bounds_per_row = _lengths(table.column("turn_bounds"))
    bad = bad | (bounds_per_row < 0)
    bounds = _values(table.column("turn_bounds"), -1)
    if len(bounds):
        row = np.repeat(np.arange(table.num_rows), np.maximum(bounds_per_row, 0))
        out = (bounds < 0) | (bounds > n[row])
        bad[row[out]] = True
    return np.flatnonzero(bad)


def has_nulls(table: pa.Table) -> bool:
    """Any null, in a column or inside a list (the lazy path assumes none)."""
    return any(col.null_count or (pa.types.is_list(col.type) and pc.list_flatten(col).null_count)
               for col in table.columns)


def min_versions(table: pa.Table) -> list[int]:
    """:attr:`Trajectory.min_version` of every row: the oldest version among trained tokens (all
    tokens when none is masked in; 0 without tokens). ``table`` holds valid rows without nulls."""
    lengths = _lengths(table.column("versions"))
    out = np.zeros(table.num_rows, dtype=np.int64)
    some = lengths > 0
    if not some.any():
        return out.tolist()
    versions = _values(table.column("versions"), 0).astype(np.int64)
    mask = _values(table.column("loss_mask"), 0)
    starts = (np.cumsum(lengths) - lengths)[some]  # the rows with tokens, each one segment
    big = np.iinfo(np.int64).max
    trained = np.minimum.reduceat(np.where(mask != 0, versions, big), starts)
    every = np.minimum.reduceat(versions, starts)
    out[some] = np.where(trained != big, trained, every)
    return out.tolist()


class _Columns:
    """The Arrow columns of one decoded chunk; a lazy field is converted for the whole chunk on first
    read (one C call instead of one per row)."""

    __slots__ = ("cache", "table")

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.cache: dict[str, list[Any]] = {}

    def value(self, name: str, row: int) -> Any:
        col = self.cache.get(name)
        if col is None:
            col = self.table.column(name).to_pylist()
            if name == "rewards":
                col = [map_to_dict(v) for v in col]
            self.cache[name] = col
        return col[row]


def _lazy_field(name: str) -> property:
    slot = _SLOTS[name]
    resets_min = name in ("versions", "loss_mask")

    def get(self: LazyTrajectory) -> Any:
        try:
            return slot.__get__(self)
        except AttributeError:
            value = self._columns.value(name, self._row)
            slot.__set__(self, value)
            if resets_min:
                self._min = None  # a list handed out may be changed: recompute from it from now on
            return value

    def set_(self: LazyTrajectory, value: Any) -> None:
        slot.__set__(self, value)
        if resets_min:
            self._min = None

    return property(get, set_, doc=f"``{name}``, read from Arrow on first access.")


class LazyTrajectory(Trajectory):
    """A :class:`Trajectory` whose :data:`LAZY` fields are read from its chunk's Arrow columns on first
    access. Equal to, and pickled/copied as, the plain Trajectory with the same fields."""

    __slots__ = ("_columns", "_min", "_row")

    @property
    def min_version(self) -> int:
        try:
            cached = self._min
        except AttributeError:  # built through __init__ (dataclasses.replace): no precomputed value
            cached = None
        return cached if cached is not None else Trajectory.min_version.fget(self)  # type: ignore[attr-defined]

    def plain(self) -> Trajectory:
        return Trajectory(*(getattr(self, name) for name in _NAMES))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _NAMES)

    __hash__ = None  # type: ignore[assignment]  # mutable, like Trajectory

    def __reduce__(self) -> tuple[type[Trajectory], tuple[Any, ...]]:
        return Trajectory, tuple(getattr(self, name) for name in _NAMES)


for _name in LAZY:
    setattr(LazyTrajectory, _name, _lazy_field(_name))


def lazy_from_conformed(table: pa.Table) -> list[Trajectory]:
    """The rows of a conformed table as :class:`LazyTrajectory` — or, when a row is refused or holds a
    null, as :func:`eager_from_conformed` decodes them (it raises what ``validate`` raises)."""
    if not table.num_rows:
        return []
    if has_nulls(table) or len(invalid_rows(table)):
        return eager_from_conformed(table)
    cols = _Columns(table)
    new = object.__new__
    cls = LazyTrajectory
    eager = [table.column(name).to_pylist() for name in EAGER]
    out: list[Trajectory] = []
    append = out.append
    for row, mv, e, tk, g, si, p, r, nid, ca, gs, tt in zip(range(table.num_rows), min_versions(table), *eager,
                                                            strict=True):
        t = new(cls)
        t.episode_id, t.task_id, t.group_id, t.sample_index, t.policy = e, tk, g, si, p
        t.reward, t.node_id, t.created_at, t.gen_seconds, t.task_type = r, nid, ca, gs, tt
        t._columns, t._row, t._min = cols, row, mv
        append(t)
    return out


def eager_from_conformed(table: pa.Table) -> list[Trajectory]:
    """Every row of a conformed table as a plain :class:`Trajectory` (validated)."""
    cols = [table.column(name).to_pylist() for name in _NAMES]
    i = _NAMES.index("rewards")
    cols[i] = list(map(map_to_dict, cols[i]))
    out = list(map(Trajectory, *cols))
    for row in invalid_rows(table).tolist():
        out[row].validate()  # the first refused row raises, with validate's own message
    return out


__all__ = ["LazyTrajectory", "eager_from_conformed", "has_nulls", "invalid_rows", "lazy_from_conformed",
           "min_versions"]
