"""The embedded S3 server's metadata log, kept to its last minutes.

SeaweedFS's filer appends every metadata change (each object put or deleted: a run's log batches,
weights, checkpoints) to ``/topics/.system/log/<day>/<HH-MM>.<filer>`` in its own volumes, and never
deletes it; no flag of ``weed mini`` turns it off or bounds it (its own remedy is the shell's
``fs.log.purge -daysAgo N``, in whole days). A 10,000-step run of the math recipe without an archiver
left it growing by ~34 MB per 1,000 steps while the live objects stayed at ~12 MB
(docs/results.md, 27 November). Nothing in AstraFlow reads it; the filer's own subscribers (the S3
gateway in the same process) read the in-memory buffer and fall back to the files only when minutes
behind, so the files older than :data:`KEEP_S` are deleted through the filer's HTTP API (their bytes
then go with the next volume vacuum, :mod:`astraflow.embedded.vacuum`).
"""

from __future__ import annotations

import datetime
import json
import urllib.error
import urllib.parse
import urllib.request

LOG_DIR = "/topics/.system/log"
"""The filer's metadata log directory (SeaweedFS ``filer.SystemLogDir``)."""
KEEP_S = 300.0
"""Minutes of metadata log kept: a subscriber this far behind the filer still finds its events."""
PAGE = 1000


def _entries(filer_url: str, directory: str, timeout_s: float) -> list[dict]:
    """The filer's listing of ``directory`` (all pages; empty when it does not exist)."""
    out: list[dict] = []
    last = ""
    while True:
        query = urllib.parse.urlencode({"limit": PAGE, "lastFileName": last})
        req = urllib.request.Request(f"{filer_url.rstrip('/')}{urllib.parse.quote(directory)}/?{query}",
                                     headers={"Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as response:
                listing = json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return out
            raise
        page = listing.get("Entries") or []
        out += page
        if not listing.get("ShouldDisplayLoadMore") or not page:
            return out
        last = listing["LastFileName"]


def _delete(filer_url: str, path: str, timeout_s: float, recursive: bool = False) -> None:
    query = "?recursive=true" if recursive else ""
    req = urllib.request.Request(f"{filer_url.rstrip('/')}{urllib.parse.quote(path)}{query}", method="DELETE")
    with urllib.request.urlopen(req, timeout=timeout_s) as response:
        response.read()


def _mtime(entry: dict) -> datetime.datetime:
    return datetime.datetime.fromisoformat(entry["Mtime"])


def log_files(filer_url: str, timeout_s: float = 60.0) -> list[tuple[str, datetime.datetime]]:
    """Every metadata log file: its path and when it was last written, oldest day first."""
    return [(f["FullPath"], _mtime(f)) for day in _entries(filer_url, LOG_DIR, timeout_s)
            for f in _entries(filer_url, day["FullPath"], timeout_s)]


def purge_metadata_log(filer_url: str, keep_s: float = KEEP_S, timeout_s: float = 60.0,
                       now: datetime.datetime | None = None) -> int:
    """Delete the metadata log files last written more than ``keep_s`` ago, and the day directories
    left empty; returns how many files went."""
    now = now or datetime.datetime.now(datetime.UTC)
    cutoff = now - datetime.timedelta(seconds=keep_s)
    files = log_files(filer_url, timeout_s)
    old = [path for path, mtime in files if mtime < cutoff]
    for path in old:
        _delete(filer_url, path, timeout_s)
    kept_days = {path.rsplit("/", 1)[0] for path, mtime in files if mtime >= cutoff}
    for day in _entries(filer_url, LOG_DIR, timeout_s):  # each day listed once, in log_files
        if _mtime(day) < cutoff and day["FullPath"] not in kept_days:  # a past day, emptied
            _delete(filer_url, day["FullPath"], timeout_s, recursive=True)
    return len(old)
