"""The embedded S3 server gives deleted objects' disk back when asked (SeaweedFS keeps their bytes in
its volume files until a vacuum compacts them; the archiver asks every minute)."""

from __future__ import annotations

import os
import subprocess

import pytest

from astraflow.config import ClusterConfig
from astraflow.embedded.vacuum import vacuum
from astraflow.objstore import ObjectStore


def _disk_mb(path) -> int:
    return int(subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]) // 1024


def test_a_vacuum_frees_what_deleted_objects_held(test_cluster: ClusterConfig, unique_name) -> None:
    if test_cluster.s3.embedded_master is None:
        pytest.skip("the S3 server is not the embedded SeaweedFS")
    store = ObjectStore.from_config(test_cluster)
    volumes = test_cluster.state_dir / "seaweedfs"
    prefix = unique_name("vacuum")
    blob = os.urandom(4 * 1024 * 1024)
    for i in range(40):  # 160 MB written, all but the last deleted: what a run's churn leaves behind
        store.put_bytes(f"{prefix}/{i}", blob)
        if i:
            store.delete(f"{prefix}/{i - 1}")
    before = _disk_mb(volumes)
    vacuum(test_cluster.s3.embedded_master)
    after = _disk_mb(volumes)
    assert before - after >= 100, (before, after)
    assert store.get_bytes(f"{prefix}/39") == blob  # the live object is intact
