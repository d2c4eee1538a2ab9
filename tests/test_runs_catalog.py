"""``astraflow runs ls | show``: runs of the real bucket from its listing and Parquet footers."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest

from astraflow.archive import rows as R
from astraflow.launcher.cluster import write_cluster_file
from astraflow.objstore import ObjectStore, RunLayout
from astraflow.objstore.runs import archived_rows, checkpointed_steps, list_runs, parquet_rows

pytestmark = pytest.mark.integration


def _metrics_part(n: int) -> bytes:
    rows = [{"key": "k", "component": "raas", "kind": None, "event": None, "policy": None, "step": i,
             "time": float(i), "json": "x" * 200, "log_partition": 0, "log_offset": i, "log_timestamp_ms": i}
            for i in range(n)]
    table = pa.Table.from_pylist(rows, schema=R.METRICS_SCHEMA)
    return R.to_parquet(R.METRICS, [table], topic="t", partition=0, first_offset=0, last_offset=n - 1)


def test_runs_ls_and_show_from_listing_and_footers(test_cluster, tmp_path) -> None:
    cfg = test_cluster
    store = ObjectStore.from_config(cfg)
    lay = RunLayout(cfg.run)
    for v in (0, 1, 2):
        store.put_json(lay.manifest_key("solver", v), {"version": v})
    store.put_json(lay.dataflow_key("state.json"), {"offsets": []})
    store.put_json(lay.trainer_key("solver", "latest.json"), {"step": 7, "version": 7})
    for step in (7, 5):  # the kept checkpoints' step folders (a rollback's choices)
        store.put_json(lay.trainer_key("solver", f"step-{step:08d}/pointer.json"), {"step": step, "version": step})
    big = _metrics_part(3000)
    store.put_bytes(lay.archive_part_key(R.METRICS, None, "t", 0, 0), big)
    store.put_bytes(lay.archive_part_key(R.METRICS, None, "t", 0, 3000), _metrics_part(5))
    (summary,) = list_runs(store, cfg.run)
    assert summary.versions == {"solver": [0, 1, 2]} and summary.objects == 9
    assert summary.kept_checkpoints == {"solver": [5, 7]}
    assert summary.area_bytes["archive"] > 0 and summary.area_bytes["dataflow"] > 0
    assert checkpointed_steps(store, summary) == {"solver": 7}
    assert archived_rows(store, summary) == {"metrics": 3005}
    assert parquet_rows(store, lay.archive_part_key(R.METRICS, None, "t", 0, 0)) == 3000

    env = {"ASTRAFLOW_CONFIG": str(write_cluster_file(cfg, tmp_path / "cluster.yaml")), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "runs", "show", cfg.run, "--json"],
                         env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    doc = json.loads(out)
    assert doc["archived_rows"] == {"metrics": 3005} and doc["versions"]["solver"] == {"count": 3, "first": 0, "last": 2}
    assert doc["checkpointed_step"] == {"solver": 7} and doc["kept_checkpoints"] == {"solver": [5, 7]}
    ls = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "runs", "ls", "--json"],
                        env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    (row,) = [json.loads(line) for line in ls.splitlines() if json.loads(line)["run"] == cfg.run]
    assert row["checkpointed_step"] == {"solver": 7}
    missing = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "runs", "show", "no-such-run"],
                             check=False, env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no run 'no-such-run'" in missing.stderr


class _Bytes:
    """get_tail over bytes in memory: the footer parsing alone (the ranged GET is tested above)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.reads = data, []

    def get_tail(self, key: str, size: int) -> bytes:
        self.reads.append(size)
        return self.data[-size:]


def test_a_footer_longer_than_the_first_read_is_fetched_whole() -> None:
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({f"c{i}": list(range(4000)) for i in range(40)}), buf, row_group_size=10)
    data = _Bytes(buf.getvalue())
    assert parquet_rows(data, "k") == 4000 and len(data.reads) == 2 and data.reads[1] > 64 * 1024
    with pytest.raises(ValueError, match="not a Parquet file"):
        parquet_rows(_Bytes(b"garbage" * 10), "k")
