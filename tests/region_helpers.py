"""A regional replica of a bucket for the region tests: a second SeaweedFS (``SeaweedServer``) fed by the
``weed filer.sync`` of :mod:`astraflow.embedded.replica`, and the bytes a server's S3 gateway sent (its
own Prometheus counter), which tell which server a node read from."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Self

from astraflow.embedded.ports import LOOPBACK
from astraflow.embedded.replica import FilerSync, SeaweedServer


def sent_bytes(server: SeaweedServer, bucket: str = "astraflow") -> int:
    """Bytes ``server``'s S3 gateway has sent from ``bucket`` (its own Prometheus counter)."""
    text = urllib.request.urlopen(f"http://{LOOPBACK}:{server.metrics_port}/metrics", timeout=5).read().decode()
    pattern = rf'^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{{bucket="{re.escape(bucket)}"\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    return int(float(match.group(1))) if match else 0


class BucketReplica:
    """A replica SeaweedFS plus the ``filer.sync`` that feeds it from an origin filer."""

    def __init__(self, state_dir: str | Path, origin_filer: str, access_key: str, secret_key: str, *,
                 bucket: str = "astraflow", prefix: str = "", exclude: tuple[str, ...] = (),
                 source_proxy: bool = False) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.server = SeaweedServer(self.state_dir / "replica", access_key, secret_key, buckets=(bucket,),
                                    name="seaweedfs-replica")
        self.origin_filer = origin_filer
        self.bucket = bucket
        self._sync_options = {"prefix": prefix, "exclude": exclude, "source_proxy": source_proxy}
        self.sync: FilerSync | None = None

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def start(self) -> Self:
        self.server.start()
        self.sync = FilerSync(self.state_dir, self.origin_filer, self.server.filer, bucket=self.bucket,
                              **self._sync_options)
        self.sync.start()
        return self

    def pause(self) -> None:
        """Stop replication (objects written on the origin meanwhile stay missing here)."""
        if self.sync is not None:
            self.sync.stop()

    def resume(self) -> None:
        if self.sync is not None:
            self.sync.start()

    def stop(self) -> None:
        self.pause()
        self.server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
