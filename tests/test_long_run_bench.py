"""The soak benchmark's own arithmetic (benchmarks/long_run.py, benchmarks/_kills.py): storage figures per
tenth from several samples each, and the one way of finding a kill's victim."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    """benchmarks/ is scripts, not a package: imported the way long_run.py imports its helpers."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def test_storage_is_sampled_several_times_a_tenth_and_judged_on_the_tenths_means() -> None:
    long_run = _bench("long_run")
    steps = long_run.sample_steps(1000, 5)
    assert len(steps) == 50 and steps[:5] == [20, 40, 60, 80, 100] and steps[-1] == 990  # the last one early
    # a sawtooth of period 2 samples (a GC every other sample) on a flat level, and one bad tenth's peak
    sawtooth = [100 if i % 2 else 50 for i in range(50)]
    sawtooth[47] = 400
    ser = {"step": steps, "broker_objects": sawtooth, "rss_kb.trainer": [1000] * 49 + [None]}
    for name in (*long_run.TENTH_FIGURES, "broker_bytes"):
        ser.setdefault(name, [None] * 50)
    tenths = long_run.per_tenth_storage(ser, 1000)
    assert tenths["broker_objects"]["mean"][:2] == [70.0, 80.0]  # 50,100,50,100,50 then 100,50,100,50,100
    assert tenths["broker_objects"]["max"] == [100] * 9 + [400]
    assert tenths["rss_kb.trainer"]["mean"] == [1000.0] * 10 and tenths["bucket_bytes"]["mean"] == [None] * 10
    # tenths 3-10: means 70/80 alternating, then 140 in the last (400 in it): judged on the means, not a phase
    means = tenths["broker_objects"]["mean"]
    assert means[9] == 140.0
    mean = sum(means[2:]) / 8
    assert long_run.band(means, 2) == round((140 - mean) / mean, 3)
    assert long_run.band(tenths["broker_objects"]["max"], 2) == round((400 - 137.5) / 137.5, 3)


def test_victim_pid_finds_servers_by_pid_file_and_components_among_the_launchers_children(tmp_path) -> None:
    kills = _bench("_kills")
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


def test_cpu_seconds_per_step_are_read_per_tenth_from_the_processes_it_ran() -> None:
    """A child that spins for ~1.2 s while 10 'steps' pass: its role's CPU per step is its spin's share,
    tenth by tenth (a real /proc reading, not a table)."""
    import time
    from types import SimpleNamespace

    long_run = _bench("long_run")
    spin = [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.2: pass"]
    with long_run.ProcessCpu(every_s=0.05) as cpu:
        child = subprocess.Popen(spin)
        steps = {}
        for step in range(1, 11):
            time.sleep(0.1)
            steps[step] = SimpleNamespace(time=time.time())
        child.wait()
    if not cpu.available:
        pytest.skip("no /proc (not Linux): the benchmark reports no CPU figures either")
    per_tenth = long_run.cpu_per_tenth(cpu, steps)
    spinner = per_tenth["other"]  # a plain Python child: not a component nor a server
    measured = [x for x in spinner if x is not None]
    assert len(measured) >= 5  # tenths with two CPU samples inside them
    # the spinner ran flat out on its own core: ~0.1 CPU-s per 0.1-s step (a loaded machine gives less)
    assert all(0.02 <= x <= 0.2 for x in measured), spinner
