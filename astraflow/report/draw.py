"""``python -m astraflow.report.draw METRICS PNG [TITLE]``: draw ``report.png`` from a run's
``metrics.jsonl`` in a process of its own. An interrupted ``astraflow run`` starts it detached, so
Ctrl+C gives the prompt back while the picture is drawn (matplotlib took 6.7 s of a 12.6 s exit
on the loaded 2-core machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from astraflow.report.metrics import load_metrics
from astraflow.report.plot import write_report


def draw_detached(metrics: Path, png: Path, title: str) -> None:
    """Start the drawing in its own session (a second Ctrl+C to the terminal does not stop it); its
    errors go to ``<png>.log``."""
    log = open(png.with_suffix(".log"), "w")  # noqa: SIM115 - the child holds it; closed here after the start
    try:
        subprocess.Popen([sys.executable, "-m", "astraflow.report.draw", str(metrics), str(png), title],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    metrics, png, title = Path(args[0]), Path(args[1]), (args[2] if len(args) > 2 else "")
    partial = png.with_suffix(".partial.png")  # renamed once complete: a reader never sees half a picture
    write_report(load_metrics(metrics), partial, title=title)
    partial.replace(png)
    png.with_suffix(".log").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
