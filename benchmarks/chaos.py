"""Chaos: a real ``astraflow run`` while a schedule of SIGKILLs hits every component type.

    .venv/bin/python benchmarks/chaos.py                      # default: 40 steps, 10 kills
    .venv/bin/python benchmarks/chaos.py --steps 60 --schedule 5:raas,10:dataflow,15:trainer
    .venv/bin/python benchmarks/chaos.py --rounds 1 --every 4 --steps 24   # quicker

The run is real: ``astraflow run`` as a subprocess on the math recipe (examples/recipes/math.yaml,
the CPU demo model: HF engine, torch trainer), its own runs dir and a PRIVATE embedded stack (Tansu +
SeaweedFS in a temporary state dir, the durable default ``s3`` log storage), ``--no-live``. The
launcher supervises everything it started, the two servers included; the benchmark only kills.

Kill schedule (deterministic, by trainer step): kill ``i`` fires once a trainer step record with
``step >= trigger_i`` reached ``runs/<run>/metrics.jsonl`` AFTER the previous kill, and the previous
victim was restarted (its supervisor ``restart`` record is there). Default: ``--rounds 2`` rounds of
``raas, dataflow, trainer, tansu, seaweedfs``, every ``--every 3`` steps from step 3 (10 kills in a
40-step run). A component (``raas`` = the RaaS node, ``dataflow``, ``trainer``) is found among the
launcher's child processes by its sub-command; a server by its pid file in the state dir. The victim
gets SIGKILL (its process group when it leads one of its own, else the pid).

Definitions (times from the wall clock of this machine; every process is local):
* ``restart_s``: kill -> the launcher's supervisor ``restart`` record of the victim (``time``
  field: when the new process was started, backoff included).
* ``recovery_s``: kill -> the first trainer step record written after the restart whose step is
  above the highest step recorded before the kill: the run makes NEW progress with the restarted
  component in place. For a trainer kill this includes re-training the steps after its checkpoint.
  Reported per kill and as mean/max per component type.
* tasks (the dataflow's own counters from its last metrics record; they are part of its
  checkpointed state, so a dataflow restarted from its checkpoint counts a task it emits again
  once): ``emitted`` (``tasks.emitted``), ``finished`` (every group of the task finalised, kept or
  dropped by a rule), ``expired`` (``tasks.expired``, ``task_timeout_s``), ``in_flight`` (at the
  end), ``reemitted_lost`` (re-sent because the log lost their records; not extra tasks).
  ``unaccounted = emitted - finished - expired - in_flight`` (target 0).
  Groups of finished tasks: ``kept`` (to the batcher) or ``dropped`` by reason (``group_too_small``,
  ``filter:<name>``, e.g. dynamic sampling's all-equal rewards). Kept groups are ``batched`` or still
  ``buffered``. ``groups_unaccounted = finished - dropped - batched - buffered`` (target 0).
  Trajectories dropped by reason (``stale``, ``duplicate``, ``unknown_task``, ``expired``,
  ``in_dropped_group``) are reported as counted.
* batch ids (sequential per policy, part of the dataflow's state): ``made`` by the final state,
  ``trained`` (the final step), ``skipped_by_trainer`` (re-made by a restarted dataflow with an id
  the trainer had trained from the lost life's batch), ``trained_made_by_a_lost_dataflow_life`` (ids
  at or above the final state's sequence: their groups are still buffered or in flight there), and
  ``made_not_trained_at_end = made - skipped - (trained - lost-life ones)`` (the dataflow ran ahead).
  The balance is per batch id, not per task: a re-made batch may hold other tasks than the trained
  batch with its id, so a task may be in two trained batches or none; checking that needs the
  batches topic, which this benchmark does not read.
* batches (the trainer's step records carry ``batch_id``, ``step`` and ``life``; a ``start`` record
  gives the step a life resumed from, i.e. its checkpoint): a batch trained in life A at step s and
  again in a later life B is ``retrained_after_crash`` when s > B's start step (trained after the
  checkpoint: the documented re-do) and ``checkpointed_trained_twice`` when s <= B's start step
  (target 0). ``in_final_lineage_twice``: a batch id at two steps of the final lineage (for each
  step, the record of the last life that trained it; target none). ``steps_without_record``: steps
  trained and checkpointed by a life killed before their step record (sent once the version is
  published) went out. ``skipped_duplicate``: the trainer's ``skipped`` records.
* ``finished``: launcher exit status 0, a trainer ``done`` record and step records up to ``--steps``.

Prints a human summary on stderr and ONE JSON line last on stdout. Exit status 0 when the target
(finished, 0 tasks unaccounted, 0 checkpointed batches trained twice) is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _kills import SUPERVISOR_NAME as KILLABLE_NAMES
from _kills import victim_pid

from astraflow.records.control import (
    ControlRecord,
    ControlRecordError,
    DataflowCounters,
    SupervisorEvent,
    TrainerDone,
    TrainerSkipped,
    TrainerStart,
    TrainerStep,
    parse_control,
)

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "recipes" / "math.yaml"
COMPONENTS = ("raas", "dataflow", "trainer")
DEFAULT_ORDER = ("raas", "dataflow", "trainer", "tansu", "seaweedfs")
SUPERVISOR_NAME = {kind: KILLABLE_NAMES[kind] for kind in DEFAULT_ORDER}
"""The kinds this benchmark kills (not the archiver) and their supervisor names."""


def sigkill(pid: int) -> None:
    """SIGKILL ``pid``'s process group when it leads one of its own, else ``pid``."""
    try:
        if os.getpgid(pid) == pid and pid != os.getpgrp():
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- the run -----------------------------------------------------------------------------------
def write_recipe(path: Path, steps: int, checkpoint_every: int | None) -> Path:
    import yaml

    data = yaml.safe_load(RECIPE.read_text())
    data["trainer"]["steps"] = steps
    if checkpoint_every:
        data["trainer"]["checkpoint_every"] = checkpoint_every
    for p in data["policies"]:
        p["model"] = str((RECIPE.parent / p["model"]).resolve())
    path.write_text(yaml.safe_dump(data))
    return path


class Launcher:
    """``astraflow run`` as a subprocess on a private embedded stack of its own (``storage`` log);
    ``extra`` are more ``astraflow run`` arguments."""

    def __init__(self, work: Path, run_id: str, recipe: Path, timeout_s: float, *extra: str,
                 storage: str = "s3") -> None:
        self.state_dir = work / "state"
        self.run_dir = work / "runs" / run_id
        self.out_path = work / "launcher.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
        env["ASTRAFLOW_STATE_DIR"] = str(self.state_dir)  # no cluster configured: a private embedded stack
        cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(recipe), "--run-id", run_id,
               "--runs-dir", str(work / "runs"), "--log-storage", storage, "--no-live",
               "--timeout", str(timeout_s), "--grace", "10", *extra]
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=work)
        self._pos = 0
        self._records: list[ControlRecord] = []

    def records(self) -> list[ControlRecord]:
        """metrics.jsonl's typed records so far (read incrementally; a partly written last line waits;
        a user's untyped figures are left out)."""
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            with open(path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                try:
                    self._records.append(parse_control(None, None, json.loads(line)))
                except (ValueError, ControlRecordError):
                    pass
            self._pos += end
        return self._records

    def output_tail(self, n: int = 3000) -> str:
        return self.out_path.read_text(errors="replace")[-n:]


def _restart_of(r: ControlRecord, component: str, since: float) -> bool:
    return (isinstance(r, SupervisorEvent) and r.component == component and r.event == "restart"
            and r.time >= since)


def parse_schedule(text: str | None, rounds: int, every: int, first: int) -> list[tuple[int, str]]:
    if text:
        out = []
        for item in text.split(","):
            step, kind = item.split(":")
            if kind not in SUPERVISOR_NAME:
                raise SystemExit(f"unknown component {kind!r} (one of {', '.join(SUPERVISOR_NAME)})")
            out.append((int(step), kind))
        return out
    kinds = list(DEFAULT_ORDER) * rounds
    return [(first + i * every, k) for i, k in enumerate(kinds)]


def drive(launcher: Launcher, schedule: list[tuple[int, str]], deadline: float) -> list[dict]:
    """Fire the kills; returns one dict per kill attempted."""
    kills: list[dict] = []
    last_kill = 0.0
    for trigger, kind in schedule:
        name = SUPERVISOR_NAME[kind]
        while True:
            if launcher.proc.poll() is not None or time.monotonic() > deadline:
                return kills
            recs = launcher.records()
            prev_ok = not kills or any(_restart_of(r, kills[-1]["component"], last_kill) for r in recs)
            reached = any(isinstance(r, TrainerStep) and r.step >= trigger and r.time > last_kill for r in recs)
            if prev_ok and reached:
                pid = victim_pid(launcher.state_dir, launcher.proc.pid, kind)
                if pid is not None:
                    break
            time.sleep(0.2)
        before = max((r.step for r in recs if isinstance(r, TrainerStep)), default=0)
        last_kill = time.time()
        sigkill(pid)
        kills.append({"component": name, "type": kind, "trigger_step": trigger, "step_at_kill": before,
                      "pid": pid, "time": last_kill})
        print(f"  kill {len(kills):2d}: {name:15s} pid {pid} at step {before}", file=sys.stderr, flush=True)
    return kills


# -- analysis ----------------------------------------------------------------------------------
def recovery(kills: list[dict], records: list[ControlRecord]) -> None:
    steps = [r for r in records if isinstance(r, TrainerStep)]
    for k in kills:
        t = k["time"]
        restart_t = min((r.time for r in records if _restart_of(r, k["component"], t)), default=None)
        k["restart_s"] = round(restart_t - t, 2) if restart_t else None
        best = max((r.step for r in steps if r.time < t), default=0)
        after = [r.time for r in steps if r.step > best and r.time > max(t, restart_t or t)]
        k["recovery_s"] = round(min(after) - t, 2) if after else None


def batch_lives(records: list[ControlRecord]) -> dict[str, Any]:
    starts = {r.life: r.step for r in records if isinstance(r, TrainerStart)}
    order = []
    for r in records:
        if isinstance(r, TrainerStart) and r.life not in order:
            order.append(r.life)
    trained: dict[str, list[tuple[int, int]]] = defaultdict(list)  # batch id -> [(life index, step)]
    for r in records:
        if isinstance(r, TrainerStep) and r.life in starts:
            trained[r.batch_id].append((order.index(r.life), r.step))
    retrained, twice = [], []
    for bid, uses in trained.items():
        uses = sorted(set(uses))
        for (la, sa), (lb, _sb) in itertools.pairwise(uses):
            if lb == la:
                twice.append({"batch_id": bid, "lives": [la, lb], "why": "same life"})
            elif sa <= starts[order[lb]]:
                twice.append({"batch_id": bid, "step": sa, "resumed_from": starts[order[lb]]})
            else:
                retrained.append(bid)
    skipped = [r for r in records if isinstance(r, TrainerSkipped)]
    # The final lineage: for each step, the batch of the last life that recorded it (a later life
    # resumed below that step re-trained it). A step with no record was trained and checkpointed by a
    # life that died before its step record (emitted after the version is published) went out.
    lineage: dict[int, str] = {}
    for r in records:
        if isinstance(r, TrainerStep) and r.life in starts:
            lineage[r.step] = r.batch_id
    final = max(lineage, default=0)
    in_lineage = Counter(lineage.values())
    return {"trainer_lives": len(order), "resumed_from_steps": [starts[life] for life in order],
            "distinct_batches_trained": len(trained), "retrained_after_crash": len(retrained),
            "checkpointed_trained_twice": len(twice), "checkpointed_trained_twice_ids": twice[:10],
            "in_final_lineage_twice": sorted(b for b, n in in_lineage.items() if n > 1),
            "steps_without_record": [s for s in range(1, final + 1) if s not in lineage],
            "lineage_ids": set(lineage.values()),
            "skipped_duplicate": sum(1 for r in skipped if r.reason == "duplicate")}


def accounting(records: list[ControlRecord], groups_per_batch: int, steps_trained: int,
               lineage_ids: set[str]) -> dict[str, Any]:
    last = None
    for r in records:
        if isinstance(r, DataflowCounters):
            last = r
    if last is None:
        return {"error": "no dataflow metrics record"}
    c = Counter(last.counters)
    emitted, finished, expired, in_flight = c["tasks.emitted"], c["tasks.finished"], c["tasks.expired"], c["tasks.in_flight"]
    dropped_groups = {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("trajectories.groups_dropped:") and v}
    batched = sum(v for k, v in c.items() if k.startswith("batches.") and k.endswith(".groups_batched"))
    seqs = {k.split(".")[1]: v for k, v in c.items() if k.startswith("batches.") and k.endswith(".batches")}
    # Trained batch ids at or above the dataflow's final sequence: made by a dataflow life lost in a
    # kill after its last state checkpoint; the final state's groups for them are still buffered/in flight.
    beyond = sum(1 for b in lineage_ids if b.rsplit("-", 1)[0] in seqs and int(b.rsplit("-", 1)[1]) >= seqs[b.rsplit("-", 1)[0]])
    buffered = sum(v for k, v in c.items() if k.startswith("batches.") and k.endswith(".groups_buffered"))
    batches = sum(v for k, v in c.items() if k.startswith("batches.") and k.endswith(".batches"))
    skipped_by_trainer = sum(v for k, v in c.items() if k.endswith(".skipped_by_trainer"))
    traj_dropped = {k.split(".", 1)[1]: v for k, v in c.items() if k in {
        "trajectories.stale", "trajectories.duplicate", "trajectories.unknown_task", "trajectories.unknown_policy",
        "trajectories.expired", "trajectories.in_dropped_group", "trajectories.invalid_records"} and v}
    return {
        "tasks": {"emitted": emitted, "finished": finished, "expired": expired, "in_flight_at_end": in_flight,
                  "reemitted_lost": c["tasks.reemitted_lost"], "duplicate_prompt_id": c["tasks.duplicate_prompt_id"],
                  "unaccounted": emitted - finished - expired - in_flight},
        "groups": {"finished": c["trajectories.groups_finished"], "kept": c["trajectories.groups_kept"],
                   "dropped": dropped_groups, "batched": batched, "buffered_at_end": buffered,
                   "unaccounted": c["trajectories.groups_finished"] - sum(dropped_groups.values()) - batched - buffered},
        "batch_ids": {"made": batches, "trained": steps_trained, "skipped_by_trainer": skipped_by_trainer,
                      "trained_made_by_a_lost_dataflow_life": beyond,
                      "made_not_trained_at_end": batches - skipped_by_trainer - (steps_trained - beyond)},
        "trajectories": {"received": c["trajectories.received"], "kept": c["trajectories.kept"],
                         "dropped": traj_dropped, "pending_at_end": c["trajectories.pending"]},
    }


def per_type(kills: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for kind in DEFAULT_ORDER:
        ks = [k for k in kills if k["type"] == kind]
        if not ks:
            continue
        rec = [k["recovery_s"] for k in ks if k["recovery_s"] is not None]
        rst = [k["restart_s"] for k in ks if k["restart_s"] is not None]
        out[kind] = {"kills": len(ks), "recovered": len(rec),
                     "restart_s_mean": round(sum(rst) / len(rst), 2) if rst else None,
                     "recovery_s_mean": round(sum(rec) / len(rec), 2) if rec else None,
                     "recovery_s_max": max(rec) if rec else None}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="trainer steps of the run (default 40)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of kills over the five component types")
    ap.add_argument("--every", type=int, default=3, help="trainer steps between kills")
    ap.add_argument("--first", type=int, default=3, help="trainer step of the first kill")
    ap.add_argument("--schedule", help="explicit schedule STEP:TYPE,... (types: " + ", ".join(SUPERVISOR_NAME) + ")")
    ap.add_argument("--checkpoint-every", type=int, default=4,
                    help="trainer.checkpoint_every (default 4, so that trainer kills land after checkpoints; 0 = the recipe's)")
    ap.add_argument("--max-restarts", type=int, default=5, help="the launcher's restart budget per component")
    ap.add_argument("--timeout", type=float, default=900.0, help="the launcher's --timeout, seconds")
    ap.add_argument("--keep", help="keep the run (state dir, runs dir, logs) in this directory")
    args = ap.parse_args(argv)
    schedule = parse_schedule(args.schedule, args.rounds, args.every, args.first)
    if schedule and max(s for s, _ in schedule) >= args.steps:
        raise SystemExit(f"the schedule's last kill (step {max(s for s, _ in schedule)}) must come before --steps {args.steps}")

    import yaml

    tmp = None
    if args.keep:
        work = Path(args.keep).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="af-chaos-")
        work = Path(tmp.name)
    recipe = write_recipe(work / "chaos-math.yaml", args.steps, args.checkpoint_every)
    rdata = yaml.safe_load(recipe.read_text())
    run_id = f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"chaos: {args.steps} steps, {len(schedule)} kills, work dir {work}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    launcher = Launcher(work, run_id, recipe, args.timeout, "--max-restarts", str(args.max_restarts))
    try:
        kills = drive(launcher, schedule, t0 + args.timeout + 60)
        try:
            rc = launcher.proc.wait(timeout=max(10.0, args.timeout + 60 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            launcher.proc.terminate()
            rc = launcher.proc.wait(60)
        wall = time.monotonic() - t0
        records = launcher.records()
        recovery(kills, records)
        final_step = max((r.step for r in records if isinstance(r, TrainerStep)), default=0)
        done = any(isinstance(r, TrainerDone) and r.step == args.steps for r in records)
        finished = rc == 0 and done and final_step >= args.steps
        events = [r for r in records if isinstance(r, SupervisorEvent)]
        restarts = Counter(r.component for r in events if r.event == "restart")
        failed = [r.component for r in events if r.event == "failed"]
        batches = batch_lives(records)
        lineage_ids = batches.pop("lineage_ids")
        acct = accounting(records, int(rdata["dataflow"]["groups_per_batch"]), final_step, lineage_ids)
        result = {
            "benchmark": "chaos", "recipe": "math", "steps": args.steps, "finished": finished, "returncode": rc,
            "final_step": final_step, "wall_s": round(wall, 1),
            "kills_scheduled": len(schedule), "kills_done": len(kills),
            "checkpoint_every": rdata["trainer"]["checkpoint_every"],
            "restarts": dict(sorted(restarts.items())), "restart_budget_exhausted": failed,
            "recovery_by_type": per_type(kills),
            "kills": [{k: v for k, v in kill.items() if k not in ("pid", "time")} for kill in kills],
            **acct, "batches": batches,
        }
        unaccounted = acct.get("tasks", {}).get("unaccounted")
        result["target_met"] = bool(finished and unaccounted == 0 and acct["groups"]["unaccounted"] == 0
                                    and batches["checkpointed_trained_twice"] == 0 and not batches["in_final_lineage_twice"]
                                    and len(kills) == len(schedule))
        print(f"chaos: {'finished' if finished else 'NOT finished'} (rc {rc}) at step {final_step}/{args.steps} in "
              f"{wall:.0f} s; {len(kills)}/{len(schedule)} kills; restarts {dict(restarts)}", file=sys.stderr)
        for kind, row in result["recovery_by_type"].items():
            print(f"  {kind:10s} kills {row['kills']} restart {row['restart_s_mean']} s, recovery mean "
                  f"{row['recovery_s_mean']} s max {row['recovery_s_max']} s", file=sys.stderr)
        if "tasks" in acct:
            print(f"  tasks {acct['tasks']}\n  groups {acct['groups']}\n  batch ids {acct['batch_ids']}\n"
                  f"  trainer {batches}", file=sys.stderr)
        if not finished:
            print("  launcher output (tail):\n" + launcher.output_tail(), file=sys.stderr)
        print(json.dumps(result), flush=True)
        return 0 if result["target_met"] else 1
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.terminate()
            try:
                launcher.proc.wait(60)
            except subprocess.TimeoutExpired:
                launcher.proc.kill()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
