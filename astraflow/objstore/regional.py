"""Reading immutable objects from a regional replica of the bucket, the origin staying the truth.

A node in another region than the bucket (``region`` in its cluster config) reads the bytes of
weights and claim-checked payloads from a replica kept by the object store's own replication, while
it shares the Kafka cluster. :class:`RegionalStore` is an :class:`ObjectStore` on the origin whose
*byte reads* (``get_bytes``, ``get_json``, ``get_file``, ``get_tail``) go to the replica:

* writes, deletes, listings and HEADs stay on the origin: the origin says what is published
  (a manifest is listed there first), the replica only serves bytes;
* an object the replica does not have yet, but the origin has, is a replication lag (an
  announcement that outran replication): with ``on_missing: wait`` the replica is polled with
  backoff up to ``max_wait_s`` and then the read fails with :class:`ReplicaLagError` (an
  :class:`ObjectStoreUnavailableError`: the caller's outage handling retries it later); with
  ``on_missing: origin`` the bytes are read from the origin at once;
* an object neither has is not found, at once (a version collected by the GC, a bad key).

Only immutable objects may be read this way: a mutable one (a checkpoint pointer) could be stale
in the replica without being missing. Every read still checks the sha256 stored at write time
(replication copies the user metadata), so a replica never serves bytes the trainer did not write.

What the reader saw is kept in :class:`ReplicaStats` (bytes per source, misses, fallbacks, the
replication lag it waited out), reported with the node's metrics and logged once per miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from astraflow.objstore.client import ObjectStore
from astraflow.objstore.errors import ObjectNotFoundError, ObjectStoreUnavailableError

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig, RegionSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class ReplicaLagError(ObjectStoreUnavailableError):
    """The origin has an object that the replica still lacks after ``max_wait_s`` (``wait`` mode)."""


@dataclass
class ReplicaStats:
    """What a :class:`RegionalStore` read, from where, and the replication lag it saw."""

    region: str
    replica_bytes: int = 0
    """Bytes read from the replica."""
    origin_bytes: int = 0
    """Bytes read from the origin (``on_missing: origin`` fallbacks)."""
    misses: int = 0
    """Reads of an object the origin had and the replica did not (yet)."""
    fallbacks: int = 0
    """Misses served by the origin."""
    timeouts: int = 0
    """Misses still missing after ``max_wait_s`` (``wait`` mode: the read failed, retried later)."""
    lags_s: list[float] = field(default_factory=list)
    """Replication lags waited out since the last :meth:`drain`: seconds from the first miss of an
    object until the replica served it (a lower bound of the object's replication lag)."""
    lag_max_s: float = 0.0
    """Longest lag waited out over the reader's life."""

    def record(self) -> dict[str, Any]:
        """The cumulative counters and the lags since the last record (``lag_s``: the longest)."""
        lags, self.lags_s = self.lags_s, []
        return {"region": self.region, "replica_bytes": self.replica_bytes, "origin_bytes": self.origin_bytes,
                "misses": self.misses, "fallbacks": self.fallbacks, "timeouts": self.timeouts,
                "lags": len(lags), "lag_s": round(max(lags), 3) if lags else None,
                "lag_max_s": round(self.lag_max_s, 3)}


class RegionalStore(ObjectStore):
    """The origin bucket, with object bytes read from the replica (see the module docstring)."""

    def __init__(self, origin: ObjectStore, replica: ObjectStore, settings: RegionSettings, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(origin.client, origin.bucket, origin.endpoint,
                         multipart_threshold=origin.multipart_threshold,
                         multipart_chunksize=origin.multipart_chunksize,
                         max_concurrency=origin.max_concurrency, body_read_attempts=origin.body_read_attempts)
        self.replica = replica
        self.settings = settings
        self.stats = ReplicaStats(settings.name)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()

    # -- byte reads: replica first -----------------------------------------------------------------
    def _read(self, key: str) -> tuple[bytes, dict[str, str]]:
        return self._regional(key, lambda: self.replica._read(key), lambda: super(RegionalStore, self)._read(key))

    def get_file(self, key: str, path: str | Path, *, verify: bool = True) -> str:
        return self._regional(key, lambda: self.replica.get_file(key, path, verify=verify),
                              lambda: super(RegionalStore, self).get_file(key, path, verify=verify),
                              size=lambda _: Path(path).stat().st_size)

    def get_tail(self, key: str, size: int) -> bytes:
        return self._regional(key, lambda: self.replica.get_tail(key, size),
                              lambda: super(RegionalStore, self).get_tail(key, size))

    def _regional(self, key: str, from_replica: Callable[[], T], from_origin: Callable[[], T],
                  size: Callable[[T], int] | None = None) -> T:
        size = size or _size
        try:
            out = from_replica()
        except ObjectNotFoundError:
            self.head(key)  # on the origin: not found there either = not found (raised here, at once)
            out = self._missing(key, from_replica, from_origin, size)
        else:
            self._count(replica=size(out))
        return out

    def _missing(self, key: str, from_replica: Callable[[], T], from_origin: Callable[[], T],
                 size: Callable[[T], int]) -> T:
        """``key`` is on the origin, not (yet) on the replica: wait for it or read the origin."""
        s, name = self.settings, self.settings.name
        with self._lock:
            self.stats.misses += 1
        if s.on_missing == "origin":
            out = from_origin()
            self._count(origin=size(out), fallback=True)
            log.info("region %s: %s is not in the replica %s yet; read it from the origin %s",
                     name, self.url(key), self.replica.endpoint, self.endpoint)
            return out
        log.info("region %s: %s is not in the replica %s yet (the origin has it); waiting up to %g s",
                 name, self.url(key), self.replica.endpoint, s.max_wait_s)
        start = self._clock()
        pause = s.backoff_initial_s
        while True:
            left = s.max_wait_s - (self._clock() - start)
            if left <= 0:
                with self._lock:
                    self.stats.timeouts += 1
                raise ReplicaLagError(f"region {name}: {self.url(key)} is on the origin {self.endpoint} but not "
                                      f"in the replica {self.replica.endpoint} after {s.max_wait_s:g} s "
                                      "(is replication running?)")
            self._sleep(min(pause, left))
            pause = min(pause * 2, s.backoff_max_s)
            try:
                out = from_replica()
            except ObjectNotFoundError:
                continue
            lag = self._clock() - start
            self._count(replica=size(out), lag=lag)
            log.info("region %s: replica caught up on %s after %.2f s", name, self.url(key), lag)
            return out

    def _count(self, *, replica: int = 0, origin: int = 0, fallback: bool = False, lag: float | None = None) -> None:
        with self._lock:
            self.stats.replica_bytes += replica
            self.stats.origin_bytes += origin
            self.stats.fallbacks += int(fallback)
            if lag is not None:
                self.stats.lags_s.append(lag)
                self.stats.lag_max_s = max(self.stats.lag_max_s, lag)

    def __repr__(self) -> str:
        return (f"RegionalStore(region={self.settings.name!r}, replica={self.replica.endpoint!r}, "
                f"origin={self.endpoint!r}, bucket={self.bucket!r})")


def _size(out: Any) -> int:
    """Bytes of a read's result: ``bytes``, or ``(bytes, metadata)`` from ``_read``."""
    return len(out[0]) if isinstance(out, tuple) else len(out)


def open_reader(cfg: ClusterConfig, **options: Any) -> ObjectStore:
    """The store to read immutable objects (weights, claims) through: a :class:`RegionalStore` when
    ``cfg.region`` names a replica, else the origin itself. ``options`` go to
    :meth:`ObjectStore.from_config` for both endpoints."""
    if cfg.s3.endpoint is None:
        cfg = cfg.resolve()
    origin = ObjectStore.from_config(cfg, **options)
    region = cfg.region
    if region is None:
        return origin
    s3 = cfg.s3.model_copy(update={
        "endpoint": region.s3_endpoint,
        "bucket": region.bucket or origin.bucket,
        "access_key": region.access_key or cfg.s3.access_key,
        "secret_key": region.secret_key or cfg.s3.secret_key,
        "region": region.s3_region or cfg.s3.region,
    })
    replica = ObjectStore.from_config(cfg.model_copy(update={"s3": s3}), **options)
    return RegionalStore(origin, replica, region)
