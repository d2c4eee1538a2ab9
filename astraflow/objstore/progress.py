"""A progress bar on stderr for the bytes a command reads from the bucket (``weights export``,
``replay``, an ``s3://`` model's download): drawn on a terminal only, so that a pipe, a log file (a
component's), or CI sees nothing of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from astraflow.objstore import ObjectStore


@contextlib.contextmanager
def transfer_progress(store: ObjectStore, description: str, total_bytes: int | None = None,
                      console: Console | None = None) -> Iterator[None]:
    """While the block runs, a bar of the bytes ``store`` reads (``total_bytes`` None: a running count
    and rate without an end). Quiet unless ``console`` (default: stderr) is a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total_bytes or None)
        store.on_read = lambda n: progress.advance(task, n)
        try:
            yield
        finally:
            store.on_read = None
