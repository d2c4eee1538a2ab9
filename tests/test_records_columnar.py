"""Column-at-a-time trajectory decoding: the lazy and eager paths decode exactly what the row-by-row
reference (``Trajectory(**row)`` then ``validate``) does, refuse what it refuses, and keep
``min_version`` right when a lazily read list is changed."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random

import pyarrow as pa
import pytest

from astraflow.records import RecordSchemaError, Trajectory, trajectory
from astraflow.records.columnar import LazyTrajectory, min_versions
from astraflow.records.schema import map_to_dict


def reference(table: pa.Table) -> list[Trajectory]:
    """The row-by-row decoding the columnar one replaces."""
    out = []
    for row in table.select(trajectory.SCHEMA.names).cast(trajectory.SCHEMA).to_pylist():
        row["rewards"] = map_to_dict(row["rewards"])
        t = Trajectory(**row)
        t.validate()
        out.append(t)
    return out


def random_trajs(rng: random.Random, n: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        k = rng.choice([0, 1, 3, 7])
        out.append(Trajectory(
            episode_id=f"e{i}", task_id=f"t{i // 4}", group_id=f"t{i // 4}/p", sample_index=i % 4, policy="p",
            prompt_ids=[rng.randrange(100) for _ in range(rng.randrange(4))],
            response_ids=[rng.randrange(100) for _ in range(k)], logprobs=[-0.5] * k,
            versions=[rng.randrange(5) for _ in range(k)], loss_mask=[rng.choice([0, 1, 1, 2]) for _ in range(k)],
            reward=rng.random(), rewards={"a": 1.0} if i % 2 else {}, turn_bounds=[0] if k else [],
            node_id="n", created_at=float(i), gen_seconds=0.5, task_type=rng.choice(["a", "b"])))
    return out


@pytest.mark.parametrize("lazy", [False, True])
def test_decodes_like_row_by_row(lazy: bool):
    trajs = random_trajs(random.Random(7), 300)
    table = trajectory.to_table(trajs)
    table = pa.concat_tables([table.slice(0, 100), table.slice(100)]).slice(5)  # chunks and an offset
    want = reference(table)
    got = trajectory.from_table(table, lazy=lazy)
    assert [t.min_version for t in got] == [t.min_version for t in want]
    assert got == want
    assert [dataclasses.asdict(t) for t in got] == [dataclasses.asdict(t) for t in want]


def test_lazy_fields_read_on_demand_and_min_version_follows_changes():
    trajs = random_trajs(random.Random(1), 20)
    got = trajectory.from_table(trajectory.to_table(trajs), lazy=True)
    t = next(t for t in got if len(t.versions) > 1)
    assert isinstance(t, LazyTrajectory)
    t.versions[:] = [-1] * len(t.versions)
    t.loss_mask = [1] * len(t.versions)
    assert t.min_version == -1
    plain = pickle.loads(pickle.dumps(t))
    assert type(plain) is Trajectory and plain == t and copy.deepcopy(t) == t
    assert dataclasses.replace(t, reward=2.0).reward == 2.0


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("field,value,message", [
    ("versions", [1], "versions has 1 entries"),
    ("turn_bounds", [9], "turn_bounds outside"),
    ("episode_id", "", "episode_id is empty"),
])
def test_refuses_what_validate_refuses(lazy: bool, field: str, value, message: str):
    trajs = random_trajs(random.Random(2), 10)
    good = trajectory.to_table(trajs)
    rows = good.to_pylist()
    rows[6][field] = value
    rows[8]["episode_id"] = ""
    with pytest.raises(RecordSchemaError, match=message):
        trajectory.from_table(pa.Table.from_pylist(rows, schema=trajectory.SCHEMA), lazy=lazy)


def test_nulls_decode_as_before():
    trajs = random_trajs(random.Random(3), 6)
    rows = trajectory.to_table(trajs).to_pylist()
    rows[2]["versions"] = [None] * len(rows[2]["response_ids"])
    table = pa.Table.from_pylist(rows, schema=trajectory.SCHEMA)
    assert trajectory.from_table(table, lazy=True)[2].versions == rows[2]["versions"]


def test_min_versions_edge_cases():
    trajs = random_trajs(random.Random(4), 4)
    trajs[0].versions, trajs[0].loss_mask = [5, 2, 7], [0, 0, 0]  # none trained: all tokens
    trajs[1].versions, trajs[1].loss_mask = [5, 2, 7], [1, 0, 1]
    for t in trajs[:2]:
        t.response_ids, t.logprobs, t.turn_bounds = [0, 0, 0], [0.0] * 3, []
    trajs[2].versions = trajs[2].loss_mask = trajs[2].response_ids = trajs[2].logprobs = []
    trajs[2].turn_bounds = []
    assert min_versions(trajectory.to_table(trajs))[:3] == [2, 5, 0]
