"""``python -m astraflow.embedded.weed_launch mini -dir=/data ...``: ``weed`` with the embedded stack's
filer store rule, for servers AstraFlow does not start itself (compose's ``seaweedfs`` service).

It writes ``filer.toml`` into the ``-dir`` data dir (leveldb3 for a new one, leveldb2 kept for one that
already holds leveldb2's files: :func:`~astraflow.embedded.seaweedfs.choose_filer_store`), then replaces
itself with ``weed`` started in that dir, which reads ``./filer.toml`` before any other."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from astraflow.embedded.seaweedfs import find_weed_bin, write_filer_config


def data_dir_of(argv: list[str]) -> Path:
    """The ``-dir=`` (or ``-dir PATH``) argument of a ``weed`` command line."""
    for i, arg in enumerate(argv):
        for flag in ("-dir", "--dir"):
            if arg.startswith(flag + "="):
                return Path(arg.split("=", 1)[1])
            if arg == flag and i + 1 < len(argv):
                return Path(argv[i + 1])
    raise SystemExit("weed_launch: the weed command line names no data dir (-dir=PATH); "
                     f"got {' '.join(argv) or 'nothing'}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    data_dir = data_dir_of(argv).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    store = write_filer_config(data_dir, data_dir)
    print(f"weed_launch: filer store {store} in {data_dir}", file=sys.stderr, flush=True)
    os.chdir(data_dir)
    weed = find_weed_bin()
    os.execv(weed, [weed, *argv])


if __name__ == "__main__":
    main()
