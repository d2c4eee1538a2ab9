"""Archive write rate against the trajectories topic's consume rate, on a private embedded stack.

Produces ``--records`` trajectory records (one GRPO group of ``--group-size`` trajectories each,
``--tokens`` prompt and response tokens) to a run's trajectories topic, then, alternating per
repetition, reads the whole topic

* with a plain ``LogConsumer`` of its own group (decoding each record's Arrow table): the log's consume
  rate, the baseline; and
* with the :class:`~astraflow.archive.Archiver` (its own group): consume, convert to archive rows,
  write Parquet, upload to the embedded S3, commit — until every row is in the bucket.

The archiver keeps up when its rate is at least the consume rate (ratio >= 1).

    nice -n 10 python benchmarks/archive_rate.py [--records 3000] [--reps 3]

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def produce(cfg, records: int, group_size: int, tokens: int) -> int:
    from astraflow.log import LogProducer, Topics, ensure_topics
    from astraflow.records import Trajectory, episode_id_for, group_id_for, trajectory

    topics = Topics(cfg.run)
    ensure_topics(cfg, {topics.trajectories: 1, topics.metrics: 1, topics.batches("policy"): 1,
                        topics.weights("policy"): 1})
    with LogProducer(cfg, "bench-raas") as producer:
        acks = []
        for r in range(records):
            prompt = f"p{r}"
            trajs = [Trajectory(
                episode_id=episode_id_for(prompt, "policy", i), task_id=prompt,
                group_id=group_id_for(prompt, "policy"), sample_index=i, policy="policy",
                prompt_ids=list(range(tokens)), response_ids=list(range(i, i + tokens)),
                logprobs=[-0.5] * tokens, versions=[r // 100] * tokens, loss_mask=[1] * tokens,
                reward=float(i % 2), task_type="math") for i in range(group_size)]
            acks.append(producer.send_table(topics.trajectories, prompt, trajectory.to_table(trajs),
                                            trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION))
        for ack in acks:
            ack.result(timeout=120)
    return records * group_size


def consume_rate(cfg, records: int) -> float:
    """Records/s of a plain consumer reading the whole topic from its start."""
    from astraflow.log import LogConsumer, Topics

    consumer = LogConsumer(cfg, Topics(cfg.run).trajectories, f"bench-consume-{uuid.uuid4().hex[:8]}")
    try:
        seen = 0
        while not seen:  # join the group and take the first record outside the timing
            seen = len(consumer.poll(timeout_s=1, max_records=1))
        t0 = time.perf_counter()
        while seen < records:
            msgs = consumer.poll(timeout_s=1, max_records=2000)
            seen += sum(1 for m in msgs if m.table is not None)
            consumer.commit()
        return (records - 1) / (time.perf_counter() - t0)
    finally:
        consumer.close()


def archive_rate(cfg, records: int, rows: int) -> tuple[float, dict]:
    """Records/s of the archiver from its first poll until every row is uploaded and committed; the
    stats also carry ``read_records_per_s``: until the last record was read and handed to the upload
    thread (the steady-state rate: the upload thread keeps at most 4 parts pending behind the reader,
    so what is left at that point is the last part's encode and upload)."""
    from astraflow.archive import Archiver

    archiver = Archiver(cfg, ["policy"], group_id=f"bench-archive-{uuid.uuid4().hex[:8]}", flush_s=2.0)
    try:
        while not archiver.stats.records:  # join the group and take the first record outside the timing
            archiver.poll(timeout_s=1, max_records=1)
        t0 = time.perf_counter()
        while archiver.stats.records < records:
            archiver.poll(timeout_s=1)
        read_s = time.perf_counter() - t0
        archiver.flush()
        seconds = time.perf_counter() - t0
        assert archiver.stats.rows["trajectories"] == rows, archiver.stats.as_dict()
        return (records - 1) / seconds, {**archiver.stats.as_dict(), "read_records_per_s": round((records - 1) / read_s)}
    finally:
        archiver.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=3000, help="trajectory records (groups) on the topic")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="prompt and response tokens per trajectory")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from astraflow.testing.runs import private_cluster

    with private_cluster() as cluster:
        cfg = cluster.model_copy(update={"run": f"bench-archive-{uuid.uuid4().hex[:6]}"})
        t0 = time.perf_counter()
        rows = produce(cfg, args.records, args.group_size, args.tokens)
        print(f"produced {args.records} records ({rows} trajectories) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        consume, archive, read, last = [], [], [], {}
        for rep in range(args.reps):
            consume.append(consume_rate(cfg, args.records))
            rate, last = archive_rate(cfg, args.records, rows)
            archive.append(rate)
            read.append(last["read_records_per_s"])
            print(f"rep {rep}: consume {consume[-1]:.0f} records/s, archive {archive[-1]:.0f} records/s",
                  file=sys.stderr)
    c, a = statistics.median(consume), statistics.median(archive)
    print(json.dumps({
        "benchmark": "archive_rate", "records": args.records, "group_size": args.group_size,
        "tokens": args.tokens, "reps": args.reps,
        "consume_records_per_s": round(c), "archive_records_per_s": round(a),
        "consume_trajectories_per_s": round(c * args.group_size),
        "archive_trajectories_per_s": round(a * args.group_size),
        "archive_over_consume": round(a / c, 3), "keeps_up": a >= c,
        "read_records_per_s": round(statistics.median(read)),
        "read_over_consume": round(statistics.median(read) / c, 3),
        "consume_all": [round(x) for x in consume], "archive_all": [round(x) for x in archive],
        "last_archive": last,
    }))


if __name__ == "__main__":
    main()
