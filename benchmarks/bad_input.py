"""Bad input on a live run: inject malformed records into every topic a run reads, then account for
each one in the dead letters.

A short ``astraflow run`` (tiny recipe, separate component processes, private embedded stack) is
started; once its trainer has taken a step, every topic the run reads (tasks, trajectories,
batches, weight announcements, metrics) gets one record of each kind:

* ``garbage``       right headers, random bytes as the value
* ``wrong-schema``  a valid Arrow stream under a schema name nobody reads on that topic
* ``wrong-version`` the right schema name at version 99
* ``truncated``     the first half of a valid Arrow stream (JSON topics: of a valid JSON document)
* ``oversized``     a 1.5 MiB value, above the inline limit (the producer should have claim-checked it)
* ``claim-missing`` a claim check pointing at an object that is not in the bucket
* ``claim-corrupt`` a claim check pointing at an object whose bytes do not match their checksum

The run must finish (rc 0) with no component restarted, and every consumer group of the topic must
dead-letter every injected record with a reason naming the problem. Prints one JSON line last:
per topic, injected / dead-lettered (by every group that reads it) / crashed / run finished.

The injector and the accounting are :mod:`astraflow.testing.bad_records` (shared with
tests/test_bad_input.py).

    .venv/bin/python benchmarks/bad_input.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from astraflow.testing.bad_records import live_run
from astraflow.testing.runs import private_cluster

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="af-bad-input-") as tmp, private_cluster(Path(tmp) / "stack") as cfg:
        cfg = cfg.model_copy(update={"run": f"badinput-{int(time.time())}"})
        result = live_run(cfg, Path(tmp), base_recipe=ROOT / "examples" / "recipes" / "math.yaml",
                          model=ROOT / "examples" / "models" / "tiny.yaml")
    for r in result["_injected"]:
        print(f"{r.topic:40s} {r.kind:14s} {r.dead_letters}", file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}))
    return 0 if result["run_finished"] and not result["missing"] and not result["crashed"] else 1


if __name__ == "__main__":
    sys.exit(main())
