"""Disk space back from the embedded S3 server while a run deletes objects.

SeaweedFS keeps a deleted object's bytes in its volume file until the volume is vacuumed (compacted).
A run deletes all the time — old checkpoints, collected weight versions, the log's trimmed batches —
and ``weed mini``'s own schedule vacuumed once early in a run and then not again: a 5,000-step run of
the math recipe left 2.5 GB on disk for ~35 MB of live objects (``benchmarks/long_run.py``, 26
November). Asked through the master's ``/vol/vacuum`` every 20 s, it compacts every volume whose
deleted share is above the threshold, and the state dir stays within 20 s of churn of the live data
(once a minute left a 16-144 MB sawtooth in a volume holding ~12 MB of live objects: the math recipe
writes a ~4 MB checkpoint every ~3 s; a compaction copies only the live bytes). The component that
trims the run's log (the dataflow; the archiver with ``--trim-log``) does the asking where the bucket
is the embedded one, so a run without an archiver stays small on disk too.
Before each vacuum it drops the filer's metadata log older than five minutes
(:mod:`astraflow.embedded.metalog`), which SeaweedFS otherwise keeps forever.
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request

from astraflow.embedded.metalog import purge_metadata_log

log = logging.getLogger(__name__)

VACUUM_EVERY_S = 20.0
GARBAGE_THRESHOLD = 0.3
"""Compact a volume once this share of its bytes belongs to deleted objects (SeaweedFS's default)."""


def vacuum(master_url: str, timeout_s: float = 300.0) -> None:
    """Compact the volumes above :data:`GARBAGE_THRESHOLD` now (blocks until the master is done)."""
    url = f"{master_url.rstrip('/')}/vol/vacuum?garbageThreshold={GARBAGE_THRESHOLD}"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        response.read()


class VolumeVacuum:
    """:func:`vacuum` every ``every_s`` on a thread of its own until :meth:`stop`, after
    :func:`purge_metadata_log` where ``filer_url`` is given."""

    def __init__(self, master_url: str, every_s: float = VACUUM_EVERY_S, filer_url: str | None = None) -> None:
        self.master_url = master_url
        self.filer_url = filer_url
        self.every_s = every_s
        self.runs = 0
        self.errors = 0
        self.metadata_log_files_purged = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="s3-vacuum", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.filer_url is not None:
                try:
                    self.metadata_log_files_purged += purge_metadata_log(self.filer_url)
                except (OSError, ValueError, KeyError) as exc:  # a restarting S3 server, an unexpected listing
                    self.errors += 1
                    log.warning("S3 metadata log purge via %s failed (%s)", self.filer_url, exc)
            try:
                vacuum(self.master_url)
                self.runs += 1
            except (OSError, urllib.error.URLError) as exc:  # a restarting S3 server: next time
                self.errors += 1
                log.warning("S3 vacuum via %s failed (%s); trying again in %g s", self.master_url, exc, self.every_s)

    def start(self) -> VolumeVacuum:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
