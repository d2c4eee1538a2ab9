"""The embedded S3 server gives deleted objects' disk back when asked (SeaweedFS keeps their bytes in
its volume files until a vacuum compacts them; the dataflow and a trimming archiver ask every 20 s),
and keeps its own metadata log to its last minutes."""

from __future__ import annotations

import datetime
import os
import subprocess
import time

import pytest

from astraflow.config import ClusterConfig
from astraflow.embedded.metalog import log_files, purge_metadata_log
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


def test_the_metadata_log_is_kept_to_its_last_minutes(test_cluster: ClusterConfig, unique_name) -> None:
    """SeaweedFS's filer logs every object put and delete to files of its own and never drops them;
    the purge deletes those older than the margin, keeps the newer, and the server goes on serving."""
    if test_cluster.s3.embedded_filer is None:
        pytest.skip("the S3 server is not the embedded SeaweedFS")
    filer = test_cluster.s3.embedded_filer
    store = ObjectStore.from_config(test_cluster)
    prefix = unique_name("metalog")
    deadline = time.monotonic() + 90  # the filer writes its log out once a minute
    files: list[str] = []
    while not files and time.monotonic() < deadline:
        store.put_bytes(f"{prefix}/{time.monotonic()}", b"x")
        files = [path for path, _ in log_files(filer)]
        time.sleep(1)
    assert files, "the filer wrote no metadata log in 90 s"
    assert purge_metadata_log(filer, keep_s=3600) == 0  # all younger than the margin: kept
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=2)
    assert purge_metadata_log(filer, keep_s=3600, now=later) >= len(files)
    assert not set(files) & {path for path, _ in log_files(filer)}
    store.put_bytes(f"{prefix}/after", b"still served")
    assert store.get_bytes(f"{prefix}/after") == b"still served"
