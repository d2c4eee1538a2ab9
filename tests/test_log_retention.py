"""Log retention on the embedded broker's durable s3 log: records every reader of a topic has committed
past leave the log (Tansu's stored batches are deleted), and the broker then serves the rest as before;
and in a whole ``astraflow run``, the dataflow trims the log while the archive keeps every record."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from astraflow.config import ClusterConfig, LogRetentionSettings
from astraflow.embedded import EmbeddedStack
from astraflow.log.lag import groups_committed_offsets
from astraflow.log.retention import LogRetention, run_readers, trim_points
from astraflow.log.trim import TANSU_BUCKET, TANSU_CLUSTER_ID, TansuObjectTrimmer, trimmer_for
from astraflow.objstore import ObjectStore

ROOT = Path(__file__).parent.parent
TOPIC = "ret.t"


def test_a_partition_is_trimmed_only_below_every_reader() -> None:
    readers = {"t": ["a", "b"], "u": ["a"]}
    committed = {"a": {("t", 0): 40, ("t", 1): 7, ("u", 0): 3}, "b": {("t", 0): 30}}
    # t:1 has no commit of b: b may still need all of it.
    assert trim_points(readers, committed) == {("t", 0): 30, ("u", 0): 3}
    assert trim_points(readers, {"a": committed["a"]}) == {("u", 0): 3}


def test_the_run_readers_put_the_archiver_on_every_archived_topic_and_the_recovery_on_its_own() -> None:
    readers = run_readers("r", ["fast"], ["solver"])
    assert readers == {"r.tasks.fast": ["r.raas.fast", "r.dataflow-recovery"],
                       "r.batches.solver": ["r.trainer.solver", "r.trainer-rollback.solver", "r.dataflow-recovery",
                                            "r.archive"],
                       "r.weights.solver": ["r.dataflow", "r.archive"],
                       "r.trajectories": ["r.dataflow", "r.archive"],
                       "r.metrics": ["r.dataflow", "r.archive"]}
    # a run without an archiver: the same readers but the archive group, so its log is trimmed too
    assert run_readers("r", ["fast"], ["solver"], archived=False) == {
        topic: [g for g in groups if g != "r.archive"] for topic, groups in readers.items()}


def test_a_pass_while_the_broker_restarts_is_counted_apart_from_errors() -> None:
    """A broker SIGKILLed under a run makes a pass fail to read the groups' commits: that is an outage
    the next pass rides out (``unreachable``), not an error of retention (``errors``)."""
    import threading

    from kafka.errors import KafkaConnectionError

    answers = iter([KafkaConnectionError("socket disconnected"), RuntimeError("a bug"), {}, {}])
    stop = threading.Event()

    def committed(groups):
        answer = next(answers, None)
        if answer is None:
            stop.set()
            return {}
        if isinstance(answer, Exception):
            raise answer
        return answer

    retention = LogRetention({}, trimmer=None, settings=LogRetentionSettings(interval_s=0.01), committed=committed)
    retention.run(stop)
    assert (retention.stats.unreachable, retention.stats.errors, retention.stats.passes) == (1, 1, 3)


@pytest.fixture(scope="module")
def s3_log(tmp_path_factory: pytest.TempPathFactory):
    """A private embedded stack on the durable s3 log (the suite's shared one runs the memory log)."""
    state_dir = tmp_path_factory.mktemp("retention-stack")
    stack, _ = EmbeddedStack.start_private(state_dir, storage="s3")
    try:
        yield ClusterConfig(run="ret", state_dir=state_dir).resolve()
    finally:
        stack.down()


def _produce_one_per_batch(cfg: ClusterConfig, n: int, topic: str = TOPIC) -> None:
    from kafka import KafkaProducer
    from kafka.admin import NewTopic

    from astraflow.log.admin import open_admin

    admin = open_admin(cfg)
    try:
        if topic not in admin.list_topics():
            admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        admin.close()
    producer = KafkaProducer(**cfg.kafka.client_kwargs(), acks="all", linger_ms=0)
    for i in range(n):
        producer.send(topic, value=b"record-%d" % i).get(timeout=30)  # one acknowledged batch each
    producer.close()


def _commit(cfg: ClusterConfig, group: str, offset: int, topic: str = TOPIC) -> None:
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    consumer = KafkaConsumer(**cfg.kafka.client_kwargs(), group_id=group, enable_auto_commit=False)
    try:
        consumer.commit({TopicPartition(topic, 0): OffsetAndMetadata(offset, "", -1)})
    finally:
        consumer.close()


def _read_from(cfg: ClusterConfig, offset: int) -> tuple[int, list[tuple[int, bytes]]]:
    """(earliest offset the broker reports, records read from ``offset`` to the end)."""
    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(TOPIC, 0)
    consumer = KafkaConsumer(**cfg.kafka.client_kwargs(), enable_auto_commit=False)
    try:
        consumer.assign([tp])
        earliest = consumer.beginning_offsets([tp])[tp]
        consumer.seek(tp, offset)
        got: list[tuple[int, bytes]] = []
        for _ in range(20):
            got += [(r.offset, r.value) for r in consumer.poll(timeout_ms=500).get(tp, [])]
            if got and got[-1][0] == 49:
                break
        return earliest, got
    finally:
        consumer.close()


def test_the_s3_log_is_trimmed_below_the_readers_and_serves_the_rest(s3_log: ClusterConfig) -> None:
    cfg = s3_log
    _produce_one_per_batch(cfg, 50)
    trimmer = trimmer_for(cfg)
    assert isinstance(trimmer, TansuObjectTrimmer)
    tansu = ObjectStore.from_config(cfg.model_copy(update={"s3": cfg.s3.model_copy(update={"bucket": TANSU_BUCKET})}))
    prefix = trimmer.records_prefix((TOPIC, 0))
    assert prefix.startswith(f"clusters/{TANSU_CLUSTER_ID}/")
    assert len(list(tansu.list(prefix))) == 50

    readers = {TOPIC: ["ret.a", "ret.b"]}

    def retention(keep_s: float) -> LogRetention:
        return LogRetention(readers, trimmer, LogRetentionSettings(keep_s=keep_s),
                            lambda groups: groups_committed_offsets(cfg, groups))

    _commit(cfg, "ret.a", 40)
    assert retention(0).pass_once() == {}, "reader b has committed nothing: the partition stays whole"
    _commit(cfg, "ret.b", 30)
    assert retention(3600).pass_once() == {}, "nothing is an hour old: keep_s holds it all"
    assert len(list(tansu.list(prefix))) == 50

    assert retention(0).pass_once() == {(TOPIC, 0): 29}
    # Batches 0..28 are gone; 29 (before the one the trim point starts) stays for Tansu's fetch.
    assert len(list(tansu.list(prefix))) == 21
    earliest, got = _read_from(cfg, 30)
    assert earliest == 29
    assert got == [(i, b"record-%d" % i) for i in range(30, 50)]
    earliest, got = _read_from(cfg, 0)  # below the log's start: the broker serves from its start
    assert got[0] == (29, b"record-29") and got[-1][0] == 49

    from kafka import KafkaProducer

    producer = KafkaProducer(**cfg.kafka.client_kwargs(), acks="all")
    assert producer.send(TOPIC, value=b"after").get(timeout=30).offset == 50, "offsets go on after a trim"
    producer.close()


def test_a_reader_held_past_max_held_records_is_cut_and_the_loss_said(s3_log: ClusterConfig,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A reader lagging more than ``max_held_records`` behind the partition's end no longer holds it: the
    trim goes on to that far behind the end, and the pass says (an error line, a :class:`Cut` that becomes
    a typed ``log-records-dropped`` record) exactly which offsets that reader lost, once each."""
    from log_helpers import partition_offsets

    from astraflow.log.retention import Cut
    from astraflow.records.control import LogRecordsDropped, parse_control

    cfg, topic = s3_log, "ret.cut"
    _produce_one_per_batch(cfg, 40, topic)
    _commit(cfg, "ret.fast", 38, topic)
    _commit(cfg, "ret.slow", 5, topic)
    cuts: list[Cut] = []

    bounded = LogRetention({topic: ["ret.fast", "ret.slow"]}, trimmer_for(cfg),
                           LogRetentionSettings(keep_s=0, max_held_records=1000),
                           lambda groups: groups_committed_offsets(cfg, groups), on_cut=cuts.append)
    assert bounded.pass_once() == {(topic, 0): 4}, "within the bound: trimmed below the slow reader only"
    assert cuts == []
    bounded.settings = LogRetentionSettings(keep_s=0, max_held_records=10)
    with caplog.at_level("ERROR", logger="astraflow.log.retention"):
        assert bounded.pass_once() == {(topic, 0): 24}
    # 10 behind the last stored batch (39) is 29; Tansu keeps the batch before a fetch's start (28).
    assert cuts == [Cut((topic, 0), log_start=28, stored_end=39, max_held_records=10, lost={"ret.slow": (5, 27)})]
    assert partition_offsets(cfg, [(topic, 0)], end=False) == {(topic, 0): 28}
    assert "ret.slow: offsets 5..27" in caplog.text and "max_held_records=10" in caplog.text
    record = LogRecordsDropped.of(cuts[0], component="dataflow", time=1.0)
    assert parse_control(None, None, json.loads(json.dumps(record.to_json()))) == record  # a metrics.jsonl line

    assert bounded.pass_once() == {} and len(cuts) == 1, "a loss is said once"
    _produce_one_per_batch(cfg, 10, topic)  # 40..49: the bound moves on, the slow reader loses 28..37 too
    bounded.pass_once()
    assert cuts[1].lost == {"ret.slow": (28, 37)} and "ret.fast" not in cuts[1].lost, cuts


def _kill_broker(state_dir: Path, launcher: subprocess.Popen) -> None:
    os.kill(json.loads((state_dir / "tansu.pid").read_text())["pid"], signal.SIGKILL)


def _run(tmp_path: Path, steps: int, retention: dict, at_step: int,
         action: Callable[[Path, subprocess.Popen], None] = _kill_broker) -> tuple[Path, Path]:
    """``astraflow run`` of the demo's math recipe (tiny settings) on an embedded s3-log stack it starts;
    ``action(state_dir, launcher)`` once a step record >= ``at_step`` is out (by default the broker is
    SIGKILLed: the launcher restarts it)."""
    data = yaml.safe_load((ROOT / "examples" / "recipes" / "math.yaml").read_text())
    data["dataset"]["samples"] = 4
    data["dataflow"]["groups_per_batch"] = 4
    # Nothing stale: staleness depends on the order in which trajectories and announcements arrive, which a
    # broker SIGKILL shuffles against the records' timestamps that a replay orders them by (a CI run under
    # load replayed 16 trajectories as kept that the online dataflow had not); what these runs check is
    # that the archive holds what the log carried. The explicit cap keeps the default's 8 tasks in flight.
    data["dataflow"].update(max_staleness=1000, max_in_flight=8)
    data["trainer"].update(steps=steps, checkpoint_every=5)
    data["eval"]["prompts"] = 20
    data["policies"][0].update(model=str(ROOT / "examples" / "models" / "tiny.yaml"), sft={"steps": 5})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    state_dir, run_dir = tmp_path / "state", tmp_path / "runs" / "trimmed"
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(state_dir), "kafka": {"retention": retention}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env["ASTRAFLOW_CONFIG"] = str(config)
    with open(tmp_path / "launcher.out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "run", str(recipe), "--run-id",
                                 "trimmed", "--runs-dir", str(tmp_path / "runs"), "--no-live", "--log-storage", "s3",
                                 "--timeout", "240"], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 200
        while not any(r.get("component") == "trainer" and (r.get("step") or 0) >= at_step
                      for r in _records(run_dir)):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.out").read_text()[-3000:]
            time.sleep(0.2)
        action(state_dir, proc)
        rc = proc.wait(timeout=280)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, (tmp_path / "launcher.out").read_text()[-3000:]
    return run_dir, state_dir


def _stored_batch(key: str) -> tuple[str, int]:
    """``"<topic>:<partition>"`` and base offset of one of Tansu's stored batch objects."""
    _, topic, _, partition, _, name = key.rsplit("/", 5)
    return f"{topic}:{int(partition)}", int(name.removesuffix(".batch"))


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


@dataclass
class _Archived:
    """What a finished run left in its archive (read on the embedded stack again, which the run stopped)."""

    trained_steps: set[int]
    """Steps of the trainer's step records in the archive's metric rows."""
    batch_ids: set[str]
    """Batch ids in the archive's batch rows."""
    trajectories: int
    """Rows in the archive's trajectory parts."""
    stored_batches: list[str]
    """Keys of the broker's stored batches left in its bucket."""
    replay: subprocess.CompletedProcess

    def assert_replays_the_online_counts(self) -> dict:
        """``astraflow replay`` of the archive through the dataflow's code gives the online dataflow's
        counts; returns the online counters."""
        assert self.replay.returncode == 0, self.replay.stderr[-3000:]
        report = json.loads(self.replay.stdout.splitlines()[-1])
        (own,) = report["configurations"]
        online = report["online"]
        for key in ("received", "kept", "stale", "in_dropped_group", "duplicate"):
            replayed = own[key] if key in own else own["dropped"][key]
            assert replayed == online.get(f"trajectories.{key}", 0), (key, replayed, own, online)
        return online


def _archive_of(tmp_path: Path, run_dir: Path, state_dir: Path) -> _Archived:
    from astraflow.archive import rows as R
    from astraflow.archive.replay import archive_parts, read_row_groups

    stack, _ = EmbeddedStack.start_private(state_dir, storage="s3")  # the run stopped the stack it started
    try:
        cfg = ClusterConfig(run="trimmed", state_dir=state_dir).resolve()
        tansu = ObjectStore.from_config(cfg.model_copy(update={"s3": cfg.s3.model_copy(update={"bucket": TANSU_BUCKET})}))
        stored = [key for key in tansu.list(f"clusters/{TANSU_CLUSTER_ID}/topics/trimmed.") if key.endswith(".batch")]
        store = ObjectStore.from_config(cfg)

        def rows(kind: str, columns: list[str]) -> list[dict]:
            keys = [key for stream in archive_parts(store, "trimmed", kind) for key in stream]
            return [row for table in read_row_groups(store, keys) for row in table.select(columns).to_pylist()]

        trained = {row["step"] for row in rows(R.METRICS, ["component", "event", "step"])
                   if row["component"] == "trainer" and row["event"] is None and row["step"] is not None}
        batch_ids = {row["batch_id"] for row in rows(R.BATCHES, ["batch_id"])}
        trajectories = len(rows(R.TRAJECTORIES, ["episode_id"]))
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
        env["ASTRAFLOW_STATE_DIR"] = str(state_dir)
        replay = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "replay", "trimmed", "--recipe",
                                 str(run_dir / "recipe.yaml"), "--no-plot", "--json"],
                                check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        stack.down()
    return _Archived(trained, batch_ids, trajectories, stored, replay)


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_trims_its_log_and_its_archive_replays_the_online_counts(tmp_path: Path) -> None:
    """A 60-step run with retention every second and no minimum age, its broker SIGKILLed at step 40 (long
    after records were removed): the run finishes, the dataflow removed records, the broker's bucket
    holds a fraction of the batches the run produced, the archive holds every trainer step, and
    replaying it through the dataflow's own code gives the online dataflow's counts."""
    steps = 60
    run_dir, state_dir = _run(tmp_path, steps, {"keep_s": 0, "interval_s": 1}, at_step=40)
    restarts = [r for r in _records(run_dir) if r.get("kind") == "supervisor" and r.get("component") == "tansu"]
    assert [r["event"] for r in restarts].count("restart") == 1, restarts
    dataflow_log = (run_dir / "logs" / "dataflow.log").read_text()  # the dataflow trims (its last life's figures)
    summary = json.loads(next(line for line in reversed(dataflow_log.splitlines()) if line.startswith("{")))
    removed = summary["log_retention"]["records"]
    assert summary["log_retention"]["errors"] == 0 and removed > 0, summary

    archived = _archive_of(tmp_path, run_dir, state_dir)
    trained, stored = archived.trained_steps, archived.stored_batches
    assert trained == set(range(1, steps + 1))
    # What the retention said it removed is gone from the broker's bucket: on every partition it trimmed,
    # no stored batch starts below the log start it reported. (How much is left depends on when the
    # groups last committed in a run this short; the 5,000-step benchmark measures storage over time.)
    assert summary["log_retention"]["units"] > 0, summary
    log_start = summary["log_retention"]["log_start"]
    assert any(name.startswith("trimmed.tasks.default:") for name in log_start), log_start
    below = [key for key in stored if _stored_batch(key)[1] < log_start.get(_stored_batch(key)[0], -1)]
    assert not below and len(stored) > 0, below
    archived.assert_replays_the_online_counts()


KEEP_S = 2.0


def _stop_the_dataflow_while_the_log_is_trimmed(state_dir: Path, launcher: subprocess.Popen) -> None:
    """SIGSTOP the dataflow for 3 x ``KEEP_S`` while nodes, trainer and archiver go on and the log is trimmed
    meanwhile below every reader's position with no regard to the dataflow's liveness (what an archiver with
    ``--trim-log`` does), then SIGKILL it: the supervisor restarts it and the new life reads back."""
    from astraflow.process.sessions import child_processes

    [pid] = [pid for pid, argv in child_processes(launcher.pid).items() if "dataflow" in argv]
    cfg = ClusterConfig(run="trimmed", state_dir=state_dir,
                        kafka={"retention": {"keep_s": 0.0, "interval_s": 0.5}}).resolve()
    retention = LogRetention.for_run(cfg, ["default"], ["policy"])
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 3 * KEEP_S
        while time.monotonic() < deadline:
            retention.pass_once()
            time.sleep(0.5)
        committed = groups_committed_offsets(cfg, {g for groups in retention.readers.values() for g in groups})
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
    assert retention.stats.passes > 0 and retention.stats.errors == 0, retention.stats.as_dict()
    # The trimming ran while the nodes committed the tasks the stopped dataflow had in flight: only the
    # recovery position kept their records (what a restarted dataflow looks up), below what the other
    # readers had released. How many stored batches a pass removes depends on timing; this does not.
    recovery = f"{cfg.run}.dataflow-recovery"
    held = trim_points(retention.readers, committed)
    released = trim_points({t: [g for g in gs if g != recovery] for t, gs in retention.readers.items()}, committed)
    assert any(released[tp] > held.get(tp, 0) for tp in released if ".tasks." in tp[0]), (held, released)


@pytest.mark.integration
@pytest.mark.slow
def test_a_dataflow_down_longer_than_keep_s_finds_everything_it_reads_back(tmp_path: Path) -> None:
    """Retention follows positions, not clocks: the dataflow down for 3 x keep_s while the log is trimmed,
    then restarted, finds the task and batch records its lost life sent after its last save and every
    in-flight task's record (its recovery position holds them): no task drawn again as lost, no
    trajectory dropped as unknown, every step trained once."""
    steps = 40
    run_dir, _ = _run(tmp_path, steps, {"keep_s": KEEP_S, "interval_s": 0.5}, at_step=15,
                      action=_stop_the_dataflow_while_the_log_is_trimmed)
    records = _records(run_dir)
    restarts = [r for r in records if r.get("kind") == "supervisor" and r.get("component") == "dataflow"]
    assert [r["event"] for r in restarts].count("restart") == 1, restarts
    counters = [r for r in records if r.get("component") == "dataflow" and isinstance(r.get("counters"), dict)]
    last = counters[-1]["counters"]
    assert last.get("tasks.reemitted_lost", 0) == 0, last
    assert last.get("trajectories.unknown_task", 0) == 0, last
    trained = [r["step"] for r in records if r.get("component") == "trainer" and not r.get("event")
               and r.get("step") is not None]
    assert sorted(set(trained)) == list(range(1, steps + 1)), trained


def _stop_the_archiver_while_the_dataflow_trims(state_dir: Path, launcher: subprocess.Popen) -> None:
    """SIGSTOP the archiver for 3 x ``KEEP_S`` while nodes, trainer and dataflow go on (the dataflow trims
    the log every 0.5 s, records older than ``KEEP_S``), then SIGKILL it: the supervisor restarts it and
    the new life reads on from the archive group's committed offsets. At the end of the stop, every
    partition's log still starts at or below what the archiver has committed, though the other readers
    had released records beyond it."""
    from log_helpers import partition_offsets

    from astraflow.process.sessions import child_processes

    [pid] = [pid for pid, argv in child_processes(launcher.pid).items() if "archive" in argv]
    cfg = ClusterConfig(run="trimmed", state_dir=state_dir).resolve()
    readers = run_readers(cfg.run, ["default"], ["policy"])
    archive = f"{cfg.run}.archive"
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(3 * KEEP_S)
        committed = groups_committed_offsets(cfg, {g for groups in readers.values() for g in groups})
        starts = partition_offsets(cfg, committed[archive], end=False)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
    lost = {tp: (start, committed[archive][tp]) for tp, start in starts.items() if start > committed[archive][tp]}
    assert not lost, f"trimmed below the stopped archiver's position: {lost}"
    held = trim_points(readers, committed)
    released = trim_points({t: [g for g in gs if g != archive] for t, gs in readers.items()}, committed)
    assert any(released[tp] > held.get(tp, 0) for tp in released if tp[0] == f"{cfg.run}.trajectories"), \
        ("the other readers of the trajectories had not moved past the archiver: the stop tested nothing",
         held, released)


@pytest.mark.integration
@pytest.mark.slow
def test_an_archiver_down_longer_than_keep_s_archives_everything(tmp_path: Path) -> None:
    """Retention follows positions, not clocks, for the archiver too: stopped for 3 x keep_s while nodes,
    trainer and dataflow go on and the dataflow trims the log, then restarted, it archives every trained
    step, every batch the trainer trained and every trajectory the dataflow received (nothing lost to
    trimming), and the archive replays to the online dataflow's counts; every step is trained once."""
    # The run must outlast the stop and the restart: 40 steps took 7 s on an idle machine after step 15.
    steps = 100
    run_dir, state_dir = _run(tmp_path, steps, {"keep_s": KEEP_S, "interval_s": 0.5}, at_step=10,
                              action=_stop_the_archiver_while_the_dataflow_trims)
    records = _records(run_dir)
    restarts = [r for r in records if r.get("kind") == "supervisor" and r.get("component") == "archive"]
    assert [r["event"] for r in restarts].count("restart") == 1, restarts
    dataflow_log = (run_dir / "logs" / "dataflow.log").read_text()
    summary = json.loads(next(line for line in reversed(dataflow_log.splitlines()) if line.startswith("{")))
    assert summary["log_retention"]["errors"] == 0 and summary["log_retention"]["records"] > 0, summary
    steps_out = [r for r in records if r.get("component") == "trainer" and not r.get("event")
                 and r.get("step") is not None]
    assert sorted(r["step"] for r in steps_out) == list(range(1, steps + 1)), steps_out

    archived = _archive_of(tmp_path, run_dir, state_dir)
    assert archived.trained_steps == set(range(1, steps + 1))
    assert {r["batch_id"] for r in steps_out} <= archived.batch_ids
    online = archived.assert_replays_the_online_counts()
    assert archived.trajectories == online["trajectories.received"] > 0, (archived.trajectories, online)


def _stop_the_archiver_until_the_dataflow_cuts_it(state_dir: Path, launcher: subprocess.Popen) -> None:
    """SIGSTOP the archiver until the dataflow's log says that retention cut the log below it (the run goes
    on meanwhile), then SIGKILL it: the supervisor restarts it."""
    from astraflow.process.sessions import child_processes

    [pid] = [pid for pid, argv in child_processes(launcher.pid).items() if "archive" in argv]
    dataflow_log = state_dir.parent / "runs" / "trimmed" / "logs" / "dataflow.log"
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 120
        while "lost to trimmed.archive" not in dataflow_log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, dataflow_log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)


@pytest.mark.integration
@pytest.mark.slow
def test_an_archiver_held_past_max_held_records_is_cut_and_the_run_says_so(tmp_path: Path) -> None:
    """The hold's bound in a whole run: the archiver stopped until it lags more than max_held_records (200)
    behind a partition's end, the dataflow trims below it anyway, says so in an error line and a typed
    log-records-dropped record (in metrics.jsonl) naming the archive group and the offsets it lost; the
    run finishes, and the archive lacks what was cut."""
    from astraflow.records.control import LogRecordsDropped, parse_control

    steps = 150
    run_dir, state_dir = _run(tmp_path, steps, {"keep_s": 0.0, "interval_s": 0.5, "max_held_records": 200},
                              at_step=10, action=_stop_the_archiver_until_the_dataflow_cuts_it)
    cuts = [parse_control(None, None, r) for r in _records(run_dir) if r.get("kind") == "log-retention"]
    lost = [(c.topic, c.partition, r.first, r.last) for c in cuts if isinstance(c, LogRecordsDropped)
            for r in c.lost if r.group == "trimmed.archive"]
    assert lost and all(last >= first for _, _, first, last in lost), cuts
    # never more than the bound: each cut kept at least max_held_records behind the last stored batch
    assert all(c.max_held_records == 200 and c.stored_end - c.log_start >= 200 for c in cuts), cuts
    # each loss is said once: a reader's lost ranges on a partition follow each other without overlap
    for (topic, partition, _, last), (topic2, partition2, first2, _) in itertools.pairwise(lost):
        if (topic, partition) == (topic2, partition2):
            assert first2 > last, lost
    dataflow_log = (run_dir / "logs" / "dataflow.log").read_text()
    assert "ERROR astraflow.log.retention: log retention:" in dataflow_log
    archived = _archive_of(tmp_path, run_dir, state_dir)
    counters = [r for r in _records(run_dir) if r.get("component") == "dataflow" and isinstance(r.get("counters"), dict)]
    received = counters[-1]["counters"]["trajectories.received"]
    if any(topic == "trimmed.trajectories" for topic, *_ in lost):
        assert archived.trajectories < received, (archived.trajectories, received, lost)
    print(f"cut below the archiver: {lost}; archived {archived.trajectories} of {received} trajectories")
