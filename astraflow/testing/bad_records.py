"""Bad records for a live run: inject malformed records into every topic a run reads, then account
for each one in the run's dead letters.

Every topic a run reads (tasks, trajectories, batches, weight announcements, metrics:
:func:`run_topics`, with the consumer groups that read each) gets one record of each kind
(:data:`KINDS`) from :func:`inject`:

* ``garbage``       right headers, random bytes as the value
* ``wrong-schema``  a valid Arrow stream under a schema name nobody reads on that topic
* ``wrong-version`` the right schema name at version 99
* ``truncated``     the first half of a valid Arrow stream (JSON topics: of a valid JSON document)
* ``oversized``     a 1.5 MiB value, above the inline limit (the producer should have claim-checked it)
* ``claim-missing`` a claim check pointing at an object that is not in the bucket
* ``claim-corrupt`` a claim check pointing at an object whose bytes do not match their checksum

Every group that reads a topic must dead-letter every record injected there, with the reason
:data:`EXPECTED_REASON` names; :func:`collect_dead_letters` reads ``<run>.dead-letters`` back onto the
injected records and :func:`summarize` counts. :func:`live_run` does it all on a short
``astraflow run`` (separate component processes) on the given cluster. Used by
tests/test_bad_input.py and benchmarks/bad_input.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from astraflow.records.control import (
    TRAINER_RECORDS,
    DataflowCounters,
    NodeStatus,
    SupervisorEvent,
    TrainerStep,
)

KINDS = ("garbage", "wrong-schema", "wrong-version", "truncated", "oversized", "claim-missing", "claim-corrupt")
EXPECTED_REASON = {
    "garbage": "bad-payload",
    "wrong-schema": "schema-mismatch",
    "wrong-version": "schema-mismatch",
    "truncated": "bad-payload",
    "oversized": "oversized",
    "claim-missing": "bad-claim",
    "claim-corrupt": "bad-claim",
}
"""What every consumer group must dead-letter each kind of bad record as."""
OVERSIZED_BYTES = 1536 * 1024
"""Above the inline limit: a producer should have claim-checked a value this big."""


@dataclass
class Injected:
    """One injected record: where it landed, and the dead letters it drew."""

    topic: str
    kind: str
    key: str
    partition: int = -1
    offset: int = -1
    dead_letters: dict[str, str] = field(default_factory=dict)
    """consumer group -> dead-letter reason"""


def run_topics(run: str, pool: str, policy: str) -> dict[str, tuple[str, int, str, tuple[str, ...]]]:
    """topic -> (schema name, version, content type, consumer-group markers that read it)."""
    from astraflow.log import Topics
    from astraflow.log.codec import ARROW_STREAM, JSON
    from astraflow.records import batch, task, trajectory

    t = Topics(run)
    return {
        t.tasks(pool): (task.SCHEMA_NAME, task.SCHEMA_VERSION, ARROW_STREAM, (f"{run}.raas.{pool}",)),
        t.trajectories: (trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION, ARROW_STREAM, (f"{run}.dataflow",)),
        t.batches(policy): (batch.SCHEMA_NAME, batch.SCHEMA_VERSION, ARROW_STREAM, (f"{run}.trainer.{policy}",)),
        t.weights(policy): ("weight-announcement", 1, JSON, (f"{run}.dataflow", f"{run}.raas-weights.")),
        t.metrics: ("json", 1, JSON, (f"{run}.dataflow", f"{run}.launcher.")),
    }


def _arrow_bytes() -> bytes:
    table = pa.table({"x": pa.array(list(range(64)), pa.int64()), "s": pa.array([f"row-{i}" for i in range(64)])})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write(table)
    return sink.getvalue().to_pybytes()


def inject(cfg: Any, pool: str, policy: str) -> list[Injected]:
    """One record of every kind on every topic the run reads; returns them with their positions."""
    from kafka import KafkaProducer

    from astraflow.log.codec import ARROW_STREAM
    from astraflow.objstore import ObjectStore, RunLayout

    store, layout = ObjectStore.from_config(cfg), RunLayout(cfg.run)
    producer = KafkaProducer(**cfg.kafka.client_kwargs(), client_id="bad-input", acks="all",
                             max_request_size=4 * 1024 * 1024)
    arrow = _arrow_bytes()
    out: list[Injected] = []
    futures = []
    for topic, (schema, version, ctype, _) in run_topics(cfg.run, pool, policy).items():
        good = arrow if ctype == ARROW_STREAM else json.dumps({"version": 10**6, "component": "bad"}).encode()
        for kind in KINDS:
            name, ver, value = schema, version, good
            extra: list[tuple[str, bytes]] = []
            if kind == "garbage":
                value = os.urandom(512)
            elif kind == "wrong-schema":
                name, value = "bogus-schema", arrow
                ctype_here = ARROW_STREAM
            elif kind == "wrong-version":
                ver = 99
            elif kind == "truncated":
                value = good[: len(good) // 2]
            elif kind == "oversized":
                value = os.urandom(OVERSIZED_BYTES)
            elif kind.startswith("claim-"):
                digest = hashlib.sha256(good + kind.encode() + topic.encode()).hexdigest()
                key = layout.claim_key(digest)
                if kind == "claim-corrupt":  # stored with the right name and checksum, wrong bytes
                    store.put_bytes(key, b"corrupted " + good, sha256=digest)
                extra = [("claim", key.encode()), ("claim-sha256", digest.encode()),
                         ("claim-size", str(len(good)).encode())]
                value = b""
            ctype_here = ARROW_STREAM if kind == "wrong-schema" else ctype
            headers = [("schema", name.encode()), ("schema-version", str(ver).encode()),
                       ("content-type", ctype_here.encode()), ("producer", b"bad-input"),
                       ("policy", policy.encode()), *extra]
            rec = Injected(topic, kind, f"bad-{kind}-{topic.rsplit('.', 1)[-1]}")
            out.append(rec)
            futures.append((rec, producer.send(topic, key=rec.key.encode(), value=value, headers=headers)))
    for rec, fut in futures:
        md = fut.get(timeout=30)
        rec.partition, rec.offset = md.partition, md.offset
    producer.close()
    return out


def collect_dead_letters(cfg: Any, injected: list[Injected], pool: str, policy: str, timeout_s: float = 30.0) -> int:
    """Read ``<run>.dead-letters`` from the start; attach each dead letter to the injected record it
    came from. Returns dead letters that match no injected record."""
    import uuid

    from astraflow.log import LogConsumer, Topics

    groups = run_topics(cfg.run, pool, policy)
    by_pos = {(r.topic, r.partition, r.offset): r for r in injected}
    others = 0
    seen: set[tuple[str, int]] = set()

    def complete() -> bool:
        return all(all(any(g.startswith(m) for g in r.dead_letters) for m in groups[r.topic][3]) for r in injected)

    with LogConsumer(cfg, Topics(cfg.run).dead_letters, f"{cfg.run}.bad-input.{uuid.uuid4().hex[:6]}") as consumer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not complete():
            for m in consumer.poll(timeout_s=0.5):
                if (m.partition, m.offset) in seen:
                    continue
                seen.add((m.partition, m.offset))
                h = m.headers
                pos = (h.get("dead-letter-source-topic"), int(h.get("dead-letter-source-partition", -1)),
                       int(h.get("dead-letter-source-offset", -1)))
                rec = by_pos.get(pos)
                if rec is None:
                    others += 1
                    continue
                rec.dead_letters[h.get("dead-letter-group", "?")] = h.get("dead-letter-reason", "?")
    return others


def summarize(injected: list[Injected], pool: str, policy: str, run: str, *, rc: int, restarts: int,
              others: int, seconds: float) -> dict[str, Any]:
    """Per topic: injected, dead-lettered by every group that reads it, missing, dead-lettered with a
    reason other than :data:`EXPECTED_REASON`; and the totals, restarts and whether the run finished."""
    groups = run_topics(run, pool, policy)
    per_topic: dict[str, dict[str, Any]] = defaultdict(lambda: {"injected": 0, "dead_lettered": 0,
                                                                "wrong_reason": 0, "missing": 0})
    for r in injected:
        row = per_topic[r.topic.removeprefix(run + ".")]
        row["injected"] += 1
        readers = groups[r.topic][3]
        got = [g for g in r.dead_letters if any(g.startswith(m) for m in readers)]
        if len(got) >= len(readers) and all(any(g.startswith(m) for g in got) for m in readers):
            row["dead_lettered"] += 1
        else:
            row["missing"] += 1
        row["wrong_reason"] += sum(1 for g in got if r.dead_letters[g] != EXPECTED_REASON[r.kind])
        row["groups"] = len(readers)
    return {
        "benchmark": "bad_input",
        "kinds": list(KINDS),
        "topics": dict(per_topic),
        "injected": len(injected),
        "dead_lettered": sum(v["dead_lettered"] for v in per_topic.values()),
        "missing": sum(v["missing"] for v in per_topic.values()),
        "wrong_reason": sum(v["wrong_reason"] for v in per_topic.values()),
        "unmatched_dead_letters": others,
        "restarts": restarts,
        "crashed": restarts,
        "run_finished": rc == 0,
        "seconds": round(seconds, 1),
    }


# -- the live run ----------------------------------------------------------------------------------
def tiny_recipe(base_recipe: Path, model: Path, out_dir: Path, steps: int) -> Path:
    """``base_recipe`` (a math-style recipe: dataset, dataflow, trainer, eval, policies with a warm
    start) shrunk to a run of seconds on the ``model`` spec, written under ``out_dir``."""
    import yaml

    data = yaml.safe_load(Path(base_recipe).read_text())
    data["dataset"]["samples"] = 4
    data["dataflow"]["groups_per_batch"] = 4
    data["trainer"].update(steps=steps, checkpoint_every=1)
    data["eval"]["prompts"] = 20
    for p in data["policies"]:
        p["model"] = str(model)
        p["sft"]["steps"] = 5
    path = out_dir / "tiny-bad-input.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def records(run_dir: Path) -> list[dict]:
    """The metrics records a run left in ``<run_dir>/metrics.jsonl`` so far (a torn last line skipped)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _typed(recs: list[dict]) -> list[Any]:
    """The typed control records among ``recs`` (a user's untyped figures left out)."""
    from astraflow.report.plot import typed_records

    return typed_records(recs)


def live_run(cfg: Any, tmp: Path, *, base_recipe: Path, model: Path, steps: int = 6,
             timeout_s: float = 120.0) -> dict[str, Any]:
    """Start ``astraflow run`` on :func:`tiny_recipe` (``base_recipe`` on ``model``) as run ``cfg.run``,
    inject at trainer step >= 1, wait for the end, account. Returns the :func:`summarize` figures plus
    ``_output`` (the launcher's output tail), ``_injected`` and ``_records`` (the metrics records)."""
    from astraflow.launcher.cluster import write_cluster_file

    t0 = time.monotonic()
    cluster_file = write_cluster_file(cfg, tmp / "cluster.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env["ASTRAFLOW_CONFIG"] = str(cluster_file)
    run_dir = tmp / "runs" / cfg.run
    out_path = tmp / "launcher.out"
    cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(tiny_recipe(base_recipe, model, tmp, steps)), "--run-id", cfg.run,
           "--runs-dir", str(tmp / "runs"), "--no-live", "--timeout", str(int(timeout_s)), "--grace", "5"]
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=tmp)
    try:
        deadline = time.monotonic() + 60
        while not any(isinstance(r, TrainerStep) for r in _typed(records(run_dir))):  # trainer step 1
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no trainer step 1 (rc {proc.poll()}):\n{out_path.read_text()[-3000:]}")
            time.sleep(0.2)
        injected = inject(cfg, "default", "policy")
        rc = proc.wait(timeout=timeout_s + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    recs = records(run_dir)
    typed = _typed(recs)
    restarts = sum(1 for r in typed if isinstance(r, SupervisorEvent))
    others = collect_dead_letters(cfg, injected, "default", "policy")
    summary = summarize(injected, "default", "policy", cfg.run, rc=rc, restarts=restarts, others=others,
                        seconds=time.monotonic() - t0)
    summary["trainer_steps"] = max(r.step for r in typed if isinstance(r, TRAINER_RECORDS))
    summary["invalid_records"] = _last_counter(typed, "invalid_records")
    # Weight objects refused by the nodes (weights.refused.<reason>, weights.unreachable; none injected
    # here: tests/test_weights_refused.py corrupts a delta and an anchor under live followers).
    from astraflow.launcher.progress import RunProgress

    progress = RunProgress(cfg.run, steps, ["policy"])
    for r in typed:
        progress.update(r)
    summary["weights_refused"] = progress.weight_refusals()
    return {**summary, "_output": " ".join(out_path.read_text().split())[-3000:], "_injected": injected,
            "_records": recs}


def _last_counter(recs: list[Any], name: str) -> int:
    """The last value of the counter ``name`` in a node's or the dataflow's records."""
    for r in reversed(recs):
        if isinstance(r, (NodeStatus, DataflowCounters)) and name in r.counters:
            return r.counters[name]
    return 0
