"""Long run: does a run stay as fast, and its storage as small, at step 5,000 as at step 500?

    .venv/bin/python benchmarks/long_run.py                                  # 5,000 steps, s3 then memory
    .venv/bin/python benchmarks/long_run.py --steps 120 --samples-per-tenth 1  # a smoke (figures mean little)
    .venv/bin/python benchmarks/long_run.py --storages s3 --plot long.png --keep /tmp/long
    .venv/bin/python benchmarks/long_run.py --steps 300 --storages s3 --chaos 12 --hold-s 5   # a chaos smoke
    # the issue-38 soaks (hours each on 2 cores; never on a shared machine):
    .venv/bin/python benchmarks/long_run.py --steps 10000 --storages s3 --plot clean.png > clean.json
    .venv/bin/python benchmarks/long_run.py --steps 10000 --storages s3 --no-archive > no-archive.json
    .venv/bin/python benchmarks/long_run.py --steps 10000 --storages s3 --chaos 24 --hold-s 20 > chaos.json

Each log storage of ``--storages`` (default ``s3,memory``: the durable default measured first, the
in-memory log as the baseline second, in the same invocation) gets one real ``astraflow run`` of
``--recipe`` (default examples/recipes/math.yaml, the CPU demo) for ``--steps`` trainer steps, as a
subprocess with ``ASTRAFLOW_STATE_DIR`` set to a private temporary state dir (the launcher starts and
owns a private embedded stack: Tansu + SeaweedFS), ``--log-storage <storage>``, ``--no-live``, its own
runs dir. The benchmark only reads: ``runs/<run>/metrics.jsonl`` (incrementally) and, while the run
runs, the stack's bucket, state dir and ``/proc``. It depends on no retention or trimming code.

Definitions (``S`` = the last trainer step recorded; every process is on this machine, one clock):
* tenths: steps ``(round(k*S/10), round((k+1)*S/10)]`` for k = 0..9. A trainer step record is a
  trainer record with ``step`` and ``batch_id`` and no ``event``; its ``time`` is when the step's
  version was published (the record is sent then). A step recorded twice (a restarted trainer) counts
  its last record.
* ``s_per_step`` of a tenth: (time of its last step record - time of the previous tenth's last one)
  / the steps between; the first tenth starts at step 1's record (the SFT warm start and start-up
  are excluded). ``ratio`` = last tenth / first tenth. Beside it, per tenth, the mean of the step
  records' ``step_s`` (the optimizer step), ``wait_s`` (waiting for a batch) and ``publish_s`` (step
  end -> announcement acknowledged): where the time goes when ``s_per_step`` grows.
* hand-off latency per consumer: the components put ``handoff_ms`` per topic in their metrics
  records (send -> poll, astraflow/log/handoff.py, with up to 256 samples each). Per (component,
  topic without the run prefix), e.g. ``raas <- tasks.default``, the p50 of the merged samples of
  the records whose ``time`` falls in a tenth (tenth k ends at the time of its last step record;
  records before step 1 count in the first tenth, records after step S in none); ``ratio``
  last / first.
* ``cpu_s_per_step``: per role (each component by its sub-command, ``tansu``, ``seaweedfs``, ``other``)
  and tenth, the CPU seconds (user + system, from ``/proc`` every 2 s) its processes used between the
  tenth's first and last step records, per step: which process's work grows when ``s_per_step`` does.
* storage samples, ``--samples-per-tenth`` in each tenth of ``--steps`` (default 5, evenly spaced;
  the last a few steps (1 %, at least 2) before the end so the stack still runs), each: the broker's
  bucket (``tansu``: objects and bytes, per topic from keys
  ``clusters/<cluster>/topics/<topic>/partitions/<p>/records/<offset>.batch``; keys outside
  ``topics/`` under ``_<their kind>``; empty with the memory log, which lives in Tansu's RSS), the
  data bucket under ``<run>/``: ``trainer/`` (checkpoints), ``weights/``, ``dataflow/`` (and the size
  of ``dataflow/state.json``, the dataflow's saved state), ``archive/``, ``claims/``; bytes on disk
  of the state dir (allocated blocks, as ``du``), also per part (SeaweedFS's volume files per
  bucket: a deleted object's bytes stay there until SeaweedFS vacuums the volume); VmRSS of Tansu and
  SeaweedFS (their pid files in the state dir). ``growth`` of a series = last sample / first sample
  (the first is early in the first tenth); ``sample_s`` is what the
  listing took.

* each component's RSS at each sample (``rss_kb.<kind>``: the launcher's children by sub-command, Tansu
  and SeaweedFS by pid file; a restarted component is its new life), and ``rss_spread`` = (max - min) /
  min over all the samples (the target: flat within 0.15), ``rss_spread_of_tenth_means`` the same over
  the per-tenth means. ``bucket_objects`` / ``bucket_bytes``: the data bucket's run prefix in all.
* ``storage_per_tenth``: per storage figure (and RSS), the ``mean`` and the ``max`` of the samples in
  each tenth: a deletion sawtooth (log segments trimmed, weight versions collected) moves one sample
  by its phase, the mean of several much less. ``storage_band_after_second_tenth``: the largest
  deviation of the broker's and the bucket's objects and bytes per-tenth means, tenths 3-10, from their
  mean, as a fraction of that mean (the target: 0.10); ``storage_band_after_second_tenth_of_maxima``
  the same of the per-tenth maxima (the peaks). ``seaweedfs_spread_of_tenth_means``: the spread of
  SeaweedFS's RSS and of the state dir's bytes over the per-tenth means.
  ``ratio_last_to_second``: s/step of the last tenth / the second's.
* kills (``--kills`` or ``--chaos N``; benchmarks/_kills.py): SIGKILL or SIGSTOP/SIGCONT of every
  component kind (raas, dataflow, trainer, archive, tansu, seaweedfs) at trainer steps, one at a time
  (the next waits for recovery from the last); per kill when it was resumed and recovered, and
  ``s_per_step_excluding_outages`` per tenth and in all (steps whose interval overlaps no outage window).
* accounting (benchmarks/chaos.py's, from the dataflow's last counters and the trainer's records):
  ``tasks.unaccounted = emitted - finished - expired - in_flight`` (a finished task's groups are kept
  and batched, or dropped with a reason), ``groups.unaccounted``, batches trained twice after a
  checkpoint; ``accounting_closes`` when all are zero. ``replay`` (unless ``--no-replay`` or
  ``--no-archive``): ``astraflow replay`` of the run's archive against the online dataflow's counts.

Prints a compact table per storage on stderr and ONE JSON line last on stdout (every figure, the
commit and the date). ``--plot PATH`` writes a PNG (s/step per tenth per storage, broker objects and
Tansu RSS over steps) when matplotlib is installed. Exit status 0 when every run finished (launcher
exit 0 and step ``--steps`` recorded), its accounting closes, its archive replays to the online counts,
and the first storage's ratio (excluding outages in a run with kills) is at most ``--max-ratio``
(default 1.15; 0 turns the check off), 1 otherwise. A 5,000-step run takes hours on 2 cores: do not
start one on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _kills
import chaos
from _cpu import ProcessCpu

from astraflow.process import child_processes
from astraflow.records.control import (
    ControlRecord,
    DataflowCounters,
    NodeStatus,
    SupervisorEvent,
    TrainerStep,
)

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "recipes" / "math.yaml"
TENTHS = 10
DATA_PREFIXES = ("trainer", "weights", "dataflow", "archive", "claims")
VOLUME_FILE = re.compile(r"^(.+)_\d+\.[a-z]+$")
"""A SeaweedFS volume file of a collection (one per bucket): ``astraflow_1.dat``, ``tansu_3.idx``."""


# -- the run -----------------------------------------------------------------------------------
class Launcher(chaos.Launcher):
    """``astraflow run`` on its own private embedded stack with the given log storage."""

    def __init__(self, work: Path, run_id: str, recipe: Path, storage: str, steps: int, timeout_s: float,
                 *extra: str) -> None:
        super().__init__(work, run_id, recipe, timeout_s, "--steps", str(steps), *extra, storage=storage)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the launcher stops its components and its stack
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- storage samples ---------------------------------------------------------------------------
def proc_rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_kb(pid_file: Path) -> int | None:
    try:
        return proc_rss_kb(int(json.loads(pid_file.read_text())["pid"]))
    except (OSError, ValueError, KeyError):
        return None


def disk_bytes(path: Path) -> tuple[int, dict[str, int]]:
    """Allocated bytes under ``path`` (``du``'s figure), in all and per part: each top-level entry,
    SeaweedFS's volume files per collection (= bucket: ``seaweedfs/astraflow``, ``seaweedfs/tansu``;
    a deleted object's bytes stay in its volume until SeaweedFS vacuums it). Files that vanish
    meanwhile are skipped."""
    parts: dict[str, int] = defaultdict(int)
    for root, dirs, files in os.walk(path):
        rel = Path(root).relative_to(path).parts
        for name in files + dirs:
            try:
                size = os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
            volume = VOLUME_FILE.match(name) if rel == ("seaweedfs",) else None
            parts[f"seaweedfs/{volume.group(1)}" if volume else (rel[0] if rel else name)] += size
    return sum(parts.values()), dict(sorted(parts.items()))


class StorageProbe:
    """Reads the stack's buckets, state dir and processes (never writes)."""

    def __init__(self, state_dir: Path, run_id: str, launcher_pid: int) -> None:
        self.state_dir = state_dir
        self.run_id = run_id
        self.launcher_pid = launcher_pid
        self._client: Any = None

    def component_rss_kb(self) -> dict[str, int]:
        """VmRSS of each component the launcher runs (by its sub-command) and of the two servers."""
        out: dict[str, int] = {}
        for pid, argv in child_processes(self.launcher_pid).items():
            kind = next((k for k in (*_kills.KINDS, "sinks") if k in argv), None)
            rss = proc_rss_kb(pid) if kind else None
            if kind and rss is not None:
                out[kind] = out.get(kind, 0) + rss
        for server in _kills.SERVERS:
            rss = rss_kb(self.state_dir / f"{server}.pid")
            if rss is not None:
                out[server] = rss
        return dict(sorted(out.items()))

    def _ready(self) -> bool:
        if self._client is None and (self.state_dir / "stack.json").exists():
            from astraflow.config import ClusterConfig
            from astraflow.objstore.client import ObjectStore

            cfg = ClusterConfig(run=self.run_id, state_dir=self.state_dir).resolve()
            self._data = ObjectStore.from_config(cfg, check_bucket=False)
            self._client = self._data.client
        return self._client is not None

    def _list(self, bucket: str, prefix: str = "") -> list[tuple[str, int]]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [(o["Key"], int(o["Size"])) for page in pages for o in page.get("Contents", [])]

    def sample(self, step: int) -> dict[str, Any] | None:
        if not self._ready():
            return None
        from botocore.exceptions import BotoCoreError, ClientError

        from astraflow.dataflow.service import STATE_OBJECT
        from astraflow.log.trim import TANSU_BUCKET
        from astraflow.objstore.layout import RunLayout

        t0 = time.monotonic()
        out: dict[str, Any] = {"step": step, "time": time.time()}
        try:
            by_topic: dict[str, list[int]] = defaultdict(lambda: [0, 0])
            for key, size in self._list(TANSU_BUCKET):
                parts = key.split("/")
                name = (parts[3].removeprefix(self.run_id + ".") if len(parts) > 3 and parts[2] == "topics"
                        else "_" + (parts[2] if len(parts) > 2 else parts[0]))
                by_topic[name][0] += 1
                by_topic[name][1] += size
            out["broker"] = {"objects": sum(v[0] for v in by_topic.values()),
                             "bytes": sum(v[1] for v in by_topic.values()), "by_topic": dict(sorted(by_topic.items()))}
            data: dict[str, list[int]] = {p: [0, 0] for p in DATA_PREFIXES}
            state_key = RunLayout(self.run_id).dataflow_key(STATE_OBJECT)
            out["dataflow_state_bytes"] = None
            for key, size in self._list(self._data.bucket, self.run_id + "/"):
                kind = key.split("/")[1]
                data.setdefault(kind, [0, 0])
                data[kind][0] += 1
                data[kind][1] += size
                if key == state_key:
                    out["dataflow_state_bytes"] = size
            out["data"] = {k: {"objects": v[0], "bytes": v[1]} for k, v in data.items()}
        except (BotoCoreError, ClientError, OSError) as exc:  # the stack went down under us (the run's end): keep what we have
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["state_dir_bytes"], out["state_dir_parts"] = disk_bytes(self.state_dir)
        out["tansu_rss_kb"] = rss_kb(self.state_dir / "tansu.pid")
        out["seaweedfs_rss_kb"] = rss_kb(self.state_dir / "seaweedfs.pid")
        out["rss_kb"] = self.component_rss_kb()
        out["sample_s"] = round(time.monotonic() - t0, 3)
        return out


def sample_steps(steps: int, per_tenth: int) -> list[int]:
    """The trainer steps after which to sample: ``per_tenth`` evenly spaced in each tenth of the run,
    each ending its 1/``per_tenth`` of it, the last one a few steps early (the launcher stops the stack
    as soon as the last step is recorded)."""
    samples = per_tenth * TENTHS
    at = [max(1, round((i + 1) * steps / samples)) for i in range(samples)]
    at[-1] = max(1, steps - max(2, steps // 100))
    return sorted(set(at))


# -- analysis ----------------------------------------------------------------------------------
def step_times(records: list[ControlRecord]) -> dict[int, TrainerStep]:
    """The last record of each trainer step."""
    steps: dict[int, TrainerStep] = {}
    for r in records:
        if isinstance(r, TrainerStep):
            steps[r.step] = r
    return dict(sorted(steps.items()))


def tenth_bounds(last_step: int) -> list[tuple[int, int]]:
    return [(round(k * last_step / TENTHS), round((k + 1) * last_step / TENTHS)) for k in range(TENTHS)]


def _at_or_below(steps: dict[int, TrainerStep], step: int) -> tuple[int, float] | None:
    best = max((s for s in steps if s <= step), default=None)
    return None if best is None else (best, steps[best].time)


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def _ratio(series: list[float | None]) -> float | None:
    vals = [x for x in series if x is not None]
    return round(vals[-1] / vals[0], 3) if len(vals) >= 2 and vals[0] else None


Span = tuple[int, float] | None
"""A step record's (step, time), or None."""


def tenth_spans(steps: dict[int, TrainerStep]) -> Iterator[tuple[int, int, Span, Span]]:
    """Per tenth: its (lo, hi] steps and the (step, time) of the step records it runs between, the
    previous tenth's last and its own (the first tenth from step 1's record; None where not recorded)."""
    for lo, hi in tenth_bounds(max(steps)):
        a = _at_or_below(steps, lo) if lo > 0 else _at_or_below(steps, min(steps))
        yield lo, hi, a, _at_or_below(steps, hi)


def per_tenth(steps: dict[int, TrainerStep]) -> dict[str, Any]:
    """s/step, step_s, wait_s and publish_s per tenth, and the tenths' end times."""
    if not steps:
        return {"s_per_step": [], "ratio": None, "ends": []}
    rows: dict[str, list] = {"s_per_step": [], "step_s": [], "wait_s": [], "publish_s": [], "ends": []}
    for lo, hi, a, b in tenth_spans(steps):
        rows["s_per_step"].append(round((b[1] - a[1]) / (b[0] - a[0]), 4) if a and b and b[0] > a[0] else None)
        rows["ends"].append(b[1] if b else None)
        inside = [r for s, r in steps.items() if lo < s <= hi]
        rows["step_s"].append(_mean([r.step_s for r in inside]))
        rows["wait_s"].append(_mean([r.wait_s for r in inside]))
        rows["publish_s"].append(_mean([r.publish_s for r in inside if r.publish_s is not None]))
    return {**rows, "ratio": _ratio(rows["s_per_step"]), "ratio_last_to_second": _ratio(rows["s_per_step"][1:])}


CPU_SAMPLE_S = 2.0
"""How often the benchmark reads every process's CPU time from /proc (one scan of /proc each)."""


def cpu_per_tenth(cpu: ProcessCpu, steps: dict[int, TrainerStep]) -> dict[str, list[float | None]]:
    """CPU seconds per trainer step of each role (component, Tansu, SeaweedFS) per tenth: where the
    machine's time goes when ``s_per_step`` grows. A tenth runs from the previous tenth's last step
    record to its own (the first from step 1's)."""
    if not steps or not cpu.available:
        return {}
    out: dict[str, list[float | None]] = defaultdict(lambda: [None] * TENTHS)
    for k, (_lo, _hi, a, b) in enumerate(tenth_spans(steps)):
        if not a or not b or b[0] <= a[0]:
            continue
        for role, seconds in cpu.between(a[1], b[1]).items():
            out[role][k] = round(seconds / (b[0] - a[0]), 4)
    return dict(sorted(out.items()))


def handoffs(records: list[ControlRecord], ends: list[float | None], run_id: str) -> dict[str, dict]:
    """p50 of each consumer's hand-off samples per tenth (by record time), and last / first."""
    if not ends or ends[-1] is None:
        return {}
    merged: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in ends])
    for r in records:
        if not isinstance(r, (TrainerStep, NodeStatus, DataflowCounters)) or not r.handoff_ms:
            continue  # the records that carry hand-off figures
        h = r.handoff_ms
        t = r.time
        k = next((i for i, end in enumerate(ends) if end is not None and t <= end), None)
        if k is None:
            continue
        for topic, figures in h.items():
            name = f"{r.component} <- {topic.removeprefix(run_id + '.')}"
            merged[name][k] += figures.get("samples") or [figures["p50"]] * int(figures.get("n", 0) > 0)
    out = {}
    for name, tenths in sorted(merged.items()):
        p50 = [round(statistics.median(xs), 1) if xs else None for xs in tenths]
        out[name] = {"p50_ms": p50, "n": [len(xs) for xs in tenths], "ratio": _ratio(p50)}
    return out


def series(samples: list[dict]) -> dict[str, list]:
    """Flat series of the storage samples, one value per sample."""
    def get(s: dict, *path: str) -> Any:
        for p in path:
            s = s.get(p) if isinstance(s, dict) else None
        return s

    out = {"step": [s["step"] for s in samples],
           "broker_objects": [get(s, "broker", "objects") for s in samples],
           "broker_bytes": [get(s, "broker", "bytes") for s in samples]}
    for p in DATA_PREFIXES:
        out[f"{p}_objects"] = [get(s, "data", p, "objects") for s in samples]
        out[f"{p}_bytes"] = [get(s, "data", p, "bytes") for s in samples]
    for unit in ("objects", "bytes"):
        out[f"bucket_{unit}"] = [sum(v[unit] for v in s["data"].values()) if isinstance(s.get("data"), dict) else None
                                 for s in samples]
    for kind in sorted({k for s in samples for k in s.get("rss_kb") or {}}):
        out[f"rss_kb.{kind}"] = [(s.get("rss_kb") or {}).get(kind) for s in samples]
    for f in ("dataflow_state_bytes", "state_dir_bytes", "state_dir_parts", "tansu_rss_kb", "seaweedfs_rss_kb",
              "sample_s"):
        out[f] = [s.get(f) for s in samples]
    return out


def band(values: list[float | None], skip: int) -> float | None:
    """Largest deviation from their mean of the values after the first ``skip`` (per-tenth means or
    maxima: after the second tenth), as a fraction of that mean."""
    vals = [v for v in values[skip:] if v is not None]
    if len(vals) < 2 or not statistics.fmean(vals):
        return None
    mean = statistics.fmean(vals)
    return round(max(abs(v - mean) for v in vals) / mean, 3)


TENTH_FIGURES = ("broker_objects", "broker_bytes", "bucket_objects", "bucket_bytes", "weights_objects",
                 "state_dir_bytes", "tansu_rss_kb", "seaweedfs_rss_kb")
"""The storage series aggregated per tenth (beside every ``rss_kb.<kind>``)."""
BAND_FIGURES = ("broker_objects", "broker_bytes", "bucket_objects", "bucket_bytes")


def per_tenth_storage(ser: dict[str, list], steps: int) -> dict[str, dict[str, list]]:
    """Per storage figure, the ``mean`` and the ``max`` of the samples taken in each tenth of ``steps``
    (a sample belongs to the tenth its step falls in; ``None`` where a tenth has no value)."""
    bounds = tenth_bounds(steps)
    tenth_of = [next((k for k, (lo, hi) in enumerate(bounds) if lo < step <= hi), None) for step in ser["step"]]
    out: dict[str, dict[str, list]] = {}
    for name in (*TENTH_FIGURES, *sorted(k for k in ser if k.startswith("rss_kb."))):
        groups: list[list[float]] = [[] for _ in bounds]
        for k, value in zip(tenth_of, ser.get(name, []), strict=True):
            if k is not None and value is not None:
                groups[k].append(value)
        out[name] = {"mean": [round(statistics.fmean(g), 1) if g else None for g in groups],
                     "max": [max(g) if g else None for g in groups]}
    return out


def rss_spread(values: list[float | None]) -> float | None:
    """(max - min) / min of a component's RSS over the samples: how far from flat (the target: 0.15)."""
    vals = [v for v in values if v is not None]
    return round((max(vals) - min(vals)) / min(vals), 3) if len(vals) >= 2 and min(vals) else None


def replay_check(launcher: Launcher, run_id: str, work: Path) -> dict[str, Any]:
    """``astraflow replay`` of the run's archive (the CLI starts the stack on its state dir) against the
    online dataflow's counts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env["ASTRAFLOW_STATE_DIR"] = str(launcher.state_dir)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "replay", run_id, "--recipe",
                           str(launcher.run_dir / "recipe.yaml"), "--no-plot", "--json"], check=False, env=env,
                          cwd=work, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr[-1500:]}
    report = json.loads(proc.stdout.splitlines()[-1])
    (own,) = report["configurations"]
    online = report["online"]
    pairs = {key: (own[key] if key in own else own["dropped"][key], online.get(f"trajectories.{key}", 0))
             for key in ("received", "kept", "stale", "in_dropped_group", "duplicate")}
    return {"ok": all(a == b for a, b in pairs.values()), "replayed_vs_online": pairs,
            "replay_s": round(time.monotonic() - t0, 1)}


def measure(storage: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    run_id = f"long-{storage}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"long_run: {storage}: {args.steps} steps of {args.recipe}, work dir {work}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    schedule = schedule_of(args)
    launcher = Launcher(work, run_id, Path(args.recipe).resolve(), storage, args.steps, args.timeout,
                        *(["--no-archive"] if args.no_archive else []),
                        *(["--max-restarts", str(args.max_restarts)] if schedule else []))
    probe = StorageProbe(launcher.state_dir, run_id, launcher.proc.pid)
    driver = _kills.KillDriver(launcher.proc.pid, launcher.state_dir, schedule)
    todo = sample_steps(args.steps, args.samples_per_tenth)
    samples: list[dict] = []
    last_report = step = seen = 0
    with ProcessCpu(every_s=CPU_SAMPLE_S) as cpu:  # read once the run is over, beside its step records
        try:
            while launcher.proc.poll() is None and time.monotonic() - t0 < args.timeout + 60:
                recs = launcher.records()
                step = max([step] + [r.step for r in recs[seen:] if isinstance(r, TrainerStep)])
                seen = len(recs)
                driver.poll(step, recs)
                if todo and step >= todo[0]:
                    s = probe.sample(step)
                    if s is not None:
                        samples.append(s)
                        while todo and todo[0] <= step:
                            todo.pop(0)
                if step >= last_report + max(1, args.steps // 20):
                    last_report = step
                    print(f"  {storage}: step {step}/{args.steps} at {time.monotonic() - t0:.0f} s", file=sys.stderr,
                          flush=True)
                time.sleep(0.5)
            driver.finish(launcher.records())
            try:
                rc = launcher.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rc = None
        finally:
            driver.finish(launcher.records())
            launcher.stop()
    wall = time.monotonic() - t0
    records = launcher.records()
    steps = step_times(records)
    done = max(steps, default=0)
    finished = rc == 0 and done >= args.steps
    tenths = per_tenth(steps)
    ser = series(samples)
    growth = {k: _ratio(v) for k, v in ser.items() if k not in ("step", "sample_s", "state_dir_parts")}
    driver.finish(records)
    excl, excl_all = _kills.s_per_step_excluding(steps, tenth_bounds(done) if done else [], driver.windows())
    lives = chaos.batch_lives(records)
    lineage_ids = lives.pop("lineage_ids")
    acct = chaos.accounting(records, 0, done, lineage_ids)
    tenth_storage = per_tenth_storage(ser, args.steps)
    result = {
        "log_storage": storage, "run_id": run_id, "finished": finished, "returncode": rc, "steps_done": done,
        "wall_s": round(wall, 1),
        "s_per_step": tenths["s_per_step"], "ratio": tenths["ratio"],
        "ratio_last_to_second": tenths["ratio_last_to_second"],
        "step_s": tenths["step_s"], "wait_s": tenths["wait_s"], "publish_s": tenths["publish_s"],
        "handoff": handoffs(records, tenths["ends"], run_id),
        "cpu_s_per_step": cpu_per_tenth(cpu, steps),
        "samples": ser, "growth": growth,
        "final": samples[-1] if samples else None,
        "s_per_step_excluding_outages": excl, "s_per_step_excluding_outages_all": excl_all,
        "storage_per_tenth": tenth_storage,
        "storage_band_after_second_tenth": {k: band(tenth_storage[k]["mean"], 2) for k in BAND_FIGURES},
        "storage_band_after_second_tenth_of_maxima": {k: band(tenth_storage[k]["max"], 2) for k in BAND_FIGURES},
        "rss_spread": {k.removeprefix("rss_kb."): rss_spread(v) for k, v in ser.items() if k.startswith("rss_kb.")},
        "rss_spread_of_tenth_means": {k.removeprefix("rss_kb."): rss_spread(v["mean"])
                                      for k, v in tenth_storage.items() if k.startswith("rss_kb.")},
        "seaweedfs_spread_of_tenth_means": {k: rss_spread(tenth_storage[k]["mean"])
                                            for k in ("seaweedfs_rss_kb", "state_dir_bytes")},
        "kills": [k.as_dict() for k in driver.done], "kills_scheduled": len(schedule),
        "restarts": dict(Counter(r.component for r in records
                                 if isinstance(r, SupervisorEvent) and r.event == "restart")),
        "accounting": {**acct, "batches": lives},
    }
    if args.replay and not args.no_archive:
        result["replay"] = replay_check(launcher, run_id, work)
    tasks, groups = acct.get("tasks", {}), acct.get("groups", {})
    result["accounting_closes"] = bool(tasks.get("unaccounted") == 0 and groups.get("unaccounted") == 0
                                       and lives["checkpointed_trained_twice"] == 0
                                       and not lives["in_final_lineage_twice"])
    if not finished:
        result["launcher_output_tail"] = launcher.output_tail(1500)
    return result


def schedule_of(args: argparse.Namespace) -> list[_kills.Kill]:
    schedule = _kills.parse(args.kills) if args.kills else _kills.spread(args.chaos, args.steps, args.hold_s)
    if args.kill_broker_at:
        schedule = sorted([*schedule, _kills.Kill(args.kill_broker_at, "tansu")], key=lambda k: k.step)
    return schedule


# -- reporting ---------------------------------------------------------------------------------
def _fmt(x: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x / scale:.{digits}f}"


def print_summary(res: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"\n{res['log_storage']}: {'finished' if res['finished'] else 'NOT finished'} (rc {res['returncode']}), "
          f"{res['steps_done']} steps in {res['wall_s']:.0f} s; s/step last/first tenth = {res['ratio']}", file=err)
    print("  tenth          " + "".join(f"{k + 1:>8d}" for k in range(TENTHS)) + "   last/first", file=err)
    for field in ("s_per_step", "step_s", "wait_s", "publish_s"):
        vals = res[field]
        print(f"  {field:14s} " + "".join(f"{_fmt(v, digits=3):>8s}" for v in vals)
              + (f"   {_ratio(vals)}" if vals else ""), file=err)
    for role, vals in res["cpu_s_per_step"].items():
        print(f"  cpu s/step {role[:10]:10s}" + "".join(f"{_fmt(v, digits=3):>8s}" for v in vals)
              + f"   {_ratio(vals)}", file=err)
    for name, h in res["handoff"].items():
        print(f"  p50 ms {name[:30]:30s} " + "".join(f"{_fmt(v, digits=0):>6s}" for v in h["p50_ms"])
              + f"   {h['ratio']}", file=err)
    s = res["samples"]
    print("  sample   step  broker obj   MB  trainer MB weights MB df-state KB archive MB state-dir MB"
          "  tansu RSS MB  list s", file=err)
    for i, step in enumerate(s["step"]):
        print(f"  {i + 1:6d} {step:6d} {s['broker_objects'][i] or 0:11d} {_fmt(s['broker_bytes'][i], 2**20, 1):>5s}"
              f" {_fmt(s['trainer_bytes'][i], 2**20, 1):>11s} {_fmt(s['weights_bytes'][i], 2**20, 1):>10s}"
              f" {_fmt(s['dataflow_state_bytes'][i], 2**10, 1):>10s} {_fmt(s['archive_bytes'][i], 2**20, 1):>10s}"
              f" {_fmt(s['state_dir_bytes'][i], 2**20, 1):>12s} {_fmt(s['tansu_rss_kb'][i], 2**10, 1):>13s}"
              f" {_fmt(s['sample_s'][i]):>7s}", file=err)
    if s["state_dir_parts"]:
        print("  state dir at the last sample (MB): " + ", ".join(
            f"{k} {v / 2**20:.1f}" for k, v in (s["state_dir_parts"][-1] or {}).items() if v >= 2**20), file=err)
    for name, values in s.items():
        if name.startswith("rss_kb."):
            print(f"  RSS MB {name[7:]:10s} " + "".join(f"{_fmt(v, 2**10, 0):>6s}" for v in values)
                  + f"   spread {res['rss_spread'].get(name[7:])}", file=err)
    for name, agg in res["storage_per_tenth"].items():
        scale = 2**20 if name.endswith("_bytes") else 2**10 if "rss_kb" in name else 1
        unit = "MB" if scale != 1 else ""
        for stat in ("mean", "max"):
            print(f"  {stat} {name[:22]:22s}{unit:>3s} " + "".join(f"{_fmt(v, scale, 1):>8s}" for v in agg[stat]),
                  file=err)
    print(f"  storage band after the second tenth, of the per-tenth means: {res['storage_band_after_second_tenth']}"
          f"; of the per-tenth maxima: {res['storage_band_after_second_tenth_of_maxima']}", file=err)
    print(f"  RSS spread of the per-tenth means: {res['rss_spread_of_tenth_means']}; SeaweedFS RSS / state dir: "
          f"{res['seaweedfs_spread_of_tenth_means']}", file=err)
    if res["kills"]:
        print(f"  {len(res['kills'])}/{res['kills_scheduled']} kills; restarts {res['restarts']}; s/step excluding "
              f"outages {res['s_per_step_excluding_outages_all']} (per tenth {res['s_per_step_excluding_outages']})",
              file=err)
        for k in res["kills"]:
            print(f"    {k['signal']:4s} {k['kind']:9s} at step {k['fired_step']}: resumed +{k['resumed_s']} s, "
                  f"recovered +{k['recovered_s']} s", file=err)
    acct = res["accounting"]
    print(f"  accounting closes: {res['accounting_closes']}; tasks {acct.get('tasks')}; groups {acct.get('groups')}",
          file=err)
    if "replay" in res:
        print(f"  archive replay matches the online counts: {res['replay']['ok']} "
              f"{res['replay'].get('replayed_vs_online') or res['replay'].get('error')}", file=err)
    if not res["finished"]:
        print("  launcher output (tail):\n" + res.get("launcher_output_tail", ""), file=err)


def plot(results: dict[str, dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("long_run: matplotlib is not installed; no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for storage, res in results.items():
        axes[0].plot(range(1, len(res["s_per_step"]) + 1), res["s_per_step"], marker="o", label=storage)
        s = res["samples"]
        axes[1].plot(s["step"], [x or 0 for x in s["broker_objects"]], marker="o", label=storage)
        axes[2].plot(s["step"], [(x or 0) / 1024 for x in s["tansu_rss_kb"]], marker="o", label=storage)
    for ax, title in zip(axes, ("s / step per tenth of the run", "broker bucket objects", "Tansu RSS (MiB)")):
        ax.set_title(title)
        ax.legend()
    axes[0].set_xlabel("tenth")
    axes[1].set_xlabel("trainer step")
    axes[2].set_xlabel("trainer step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"long_run: plot in {path}", file=sys.stderr)


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000, help="trainer steps of each run (default 5000)")
    ap.add_argument("--storages", default="s3,memory",
                    help="log storages to run, in order (default s3,memory; the first one's ratio is checked)")
    ap.add_argument("--recipe", default=str(RECIPE), help="recipe YAML (default examples/recipes/math.yaml)")
    ap.add_argument("--samples-per-tenth", type=int, default=5,
                    help="storage samples in each tenth of the run (default 5; a bucket listing, a du, /proc)")
    ap.add_argument("--timeout", type=float, default=6 * 3600.0, help="the launcher's --timeout per run, seconds")
    ap.add_argument("--max-ratio", type=float, default=1.15,
                    help="exit 1 when the first storage's last/first-tenth s/step (excluding outage windows in a "
                         "run with kills) is above this (0: no check)")
    ap.add_argument("--kill-broker-at", type=int, default=None, metavar="STEP",
                    help="SIGKILL the embedded broker once at this step (its s/step tenth then holds the recovery)")
    ap.add_argument("--kills", metavar="SCHEDULE",
                    help="kill schedule STEP:KIND[:kill|stop[:SECONDS]],... (KIND: " + ", ".join(_kills.KINDS) + ")")
    ap.add_argument("--chaos", type=int, default=0, metavar="N",
                    help="N kills spread over the run, every kind with SIGKILL then SIGSTOP in turn (without --kills)")
    ap.add_argument("--hold-s", type=float, default=10.0, help="seconds a SIGSTOP of --chaos lasts (default 10)")
    ap.add_argument("--max-restarts", type=int, default=10,
                    help="the launcher's restart budget per component in a run with kills (default 10)")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="skip replaying the archive against the online counts at the end")
    ap.add_argument("--no-archive", action="store_true",
                    help="runs without an archiver (astraflow run --no-archive): the log is trimmed all the same")
    ap.add_argument("--plot", help="write a PNG here")
    ap.add_argument("--keep", help="keep the runs (state dirs, runs dirs, logs) in this directory")
    args = ap.parse_args(argv)
    head = commit()  # the code measured: HEAD when the runs start, not after hours of other commits
    storages = [s.strip() for s in args.storages.split(",") if s.strip()]
    if args.steps < TENTHS or args.samples_per_tenth < 1 or not storages:
        raise SystemExit(f"--steps must be at least {TENTHS}, --samples-per-tenth at least 1, --storages not empty")

    tmp = None
    if args.keep:
        work = Path(args.keep).resolve()
    else:
        tmp = tempfile.TemporaryDirectory(prefix="af-long-")
        work = Path(tmp.name)
    try:
        results = {s: measure(s, args, work / s) for s in storages}
    finally:
        if tmp is not None:
            tmp.cleanup()
    for res in results.values():
        print_summary(res)
    first = results[storages[0]]
    ratio = _ratio(first["s_per_step_excluding_outages"]) if first["kills"] else first["ratio"]
    ratio_ok = not args.max_ratio or (ratio is not None and ratio <= args.max_ratio)
    ok = all(r["finished"] and r["accounting_closes"] and r.get("replay", {"ok": True})["ok"]
             for r in results.values()) and ratio_ok
    if args.plot:
        plot(results, args.plot)
    out = {"benchmark": "long_run", "recipe": str(Path(args.recipe).resolve().relative_to(ROOT))
           if Path(args.recipe).resolve().is_relative_to(ROOT) else args.recipe,
           "steps": args.steps, "samples_per_tenth": args.samples_per_tenth, "no_archive": args.no_archive, "storages": results,
           "max_ratio": args.max_ratio, "ratio": ratio, "target_met": ok,
           "commit": head, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    print(json.dumps(out), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
