"""Records: round trips, schema identity, and readability by plain pyarrow (no astraflow import)."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pytest
from fakes import make_trajectory

from astraflow.records import (
    Batch,
    RecordSchemaError,
    Task,
    Trajectory,
    batch,
    identity_of,
    task,
    trajectory,
)


def make_traj(prompt_id: str = "p1", policy: str = "solver", i: int = 0, n: int = 4, reward: float = 1.0) -> Trajectory:
    return make_trajectory(prompt_id, policy, i, n=n, reward=reward, rewards={"correct": reward, "format": 0.25},
                           turn_bounds=[0], node_id="node-a", created_at=1.7e9, gen_seconds=0.125, task_type="arith")


def ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def test_task_round_trip_and_identity():
    tasks = [
        Task("p1", "1+2=", [5, 6], "3", samples=4, task_type="arith", policy="", pool="gpu",
             emitted_version=7, metadata={"difficulty": "2"}),
        Task("p2", "2+2=", answer="4"),
    ]
    table = task.to_table(tasks)
    assert table.schema.equals(task.SCHEMA)
    assert identity_of(table) == (task.SCHEMA_NAME, task.SCHEMA_VERSION)
    assert table.schema.field("prompt_ids").type == pa.list_(pa.int32())
    back = task.from_table(pa.ipc.open_stream(ipc_bytes(table)).read_all())
    assert back == tasks


def test_trajectory_round_trip_types():
    trajs = [make_traj(i=i, reward=float(i)) for i in range(3)]
    table = trajectory.to_table(trajs)
    assert table.schema.field("logprobs").type == pa.list_(pa.float32())
    assert table.schema.field("versions").type == pa.list_(pa.int32())
    assert table.schema.field("rewards").type == pa.map_(pa.string(), pa.float64())
    back = trajectory.from_table(pa.ipc.open_stream(ipc_bytes(table)).read_all())
    assert back == trajs  # -0.5 / 0.25 are exact in float32
    assert back[0].min_version == 3


def test_batch_round_trip_keeps_batch_fields():
    b = Batch("b-1", "solver", 9, [make_traj("p1", i=i) for i in range(2)] + [make_traj("p2", i=i) for i in range(2)])
    table = batch.to_table(b)
    assert identity_of(table) == (batch.SCHEMA_NAME, batch.SCHEMA_VERSION)
    back = batch.from_table(pa.ipc.open_stream(ipc_bytes(table)).read_all())
    assert back == b
    assert list(back.groups()) == ["p1/solver", "p2/solver"]
    # Batch fields are columns: survive dropping the schema metadata.
    assert batch.from_table(table.replace_schema_metadata(None)) == b


def test_plain_pyarrow_reader_in_fresh_interpreter(tmp_path):
    b = Batch("b-7", "solver", 2, [make_traj(i=i) for i in range(2)])
    path = tmp_path / "batch.arrow"
    path.write_bytes(ipc_bytes(batch.to_table(b)))
    code = f"""
import sys, pyarrow as pa
t = pa.ipc.open_stream(open({str(path)!r}, 'rb').read()).read_all()
assert 'astraflow' not in sys.modules
meta = t.schema.metadata
print(meta[b'astraflow.schema'].decode(), meta[b'astraflow.schema_version'].decode())
print(t.column('batch_id').to_pylist(), t.column('response_ids').to_pylist()[0])
print(t.column('versions').type, t.column('logprobs').type, dict(t.column('rewards').to_pylist()[0]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "astraflow.batch 1"
    assert out[1] == "['b-7', 'b-7'] [10, 11, 12, 13]"
    assert out[2] == "list<item: int32> list<item: float> {'correct': 1.0, 'format': 0.25}"


def test_bad_records_refused_clearly():
    bad = make_traj()
    bad.logprobs = bad.logprobs[:-1]
    with pytest.raises(RecordSchemaError, match="logprobs has 3 entries"):
        trajectory.to_table([bad])
    table = trajectory.to_table([make_traj()])
    with pytest.raises(RecordSchemaError, match="lacks column"):
        trajectory.from_table(table.drop_columns(["versions"]))
    with pytest.raises(RecordSchemaError, match="holds 'astraflow.trajectory' records"):
        task.from_table(table)
    with pytest.raises(RecordSchemaError, match="no trajectories"):
        batch.to_table(Batch("b", "solver", 0, []))
    with pytest.raises(RecordSchemaError, match="samples must be"):
        task.to_table([Task("p", "x", samples=0)])


def test_reader_ignores_extra_columns_and_refuses_newer_version():
    table = trajectory.to_table([make_traj()])
    extra = table.append_column("future_field", pa.array([1]))
    assert trajectory.from_table(extra) == [make_traj()]
    newer = table.replace_schema_metadata({b"astraflow.schema": b"astraflow.trajectory", b"astraflow.schema_version": b"99"})
    with pytest.raises(RecordSchemaError, match="newer"):
        trajectory.from_table(newer)
