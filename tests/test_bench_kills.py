"""The soak benchmarks' one way of finding a kill's victim (benchmarks/_kills.py ``victim_pid``, used by
long_run.py's kill driver and chaos.py): a server by its pid file, a component as the one child of the
launcher running its sub-command."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _kills_module():
    """benchmarks/ is scripts, not a package: imported the way long_run.py imports it."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module("_kills")


def test_victim_pid_finds_servers_by_pid_file_and_components_among_the_launchers_children(tmp_path) -> None:
    kills = _kills_module()
    (tmp_path / "tansu.pid").write_text(json.dumps({"pid": 4242}))
    assert kills.victim_pid(tmp_path, os.getpid(), "tansu") == 4242
    assert kills.victim_pid(tmp_path, os.getpid(), "seaweedfs") is None  # no pid file: not running
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    raas = subprocess.Popen([*sleeper, "raas"])
    trainers = [subprocess.Popen([*sleeper, "trainer"]) for _ in range(2)]
    try:
        assert kills.victim_pid(tmp_path, os.getpid(), "raas") == raas.pid
        assert kills.victim_pid(tmp_path, os.getpid(), "trainer") is None  # two: which one is ambiguous
        assert kills.victim_pid(tmp_path, os.getpid(), "dataflow") is None
    finally:
        for proc in (raas, *trainers):
            proc.kill()
            proc.wait()
