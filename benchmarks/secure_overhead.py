"""What TLS costs on the log and on a weight refresh: the embedded stack plaintext and secured
(``astraflow up --secure``: stunnel with mutual TLS in front of Tansu, HTTPS in front of SeaweedFS),
side by side in one run, each on its own temp state dir, free ports and the in-memory log.

* **log**: produce ``--records`` records of ``--size`` bytes (acks=all, kafka-python's batching), then
  consume them all from the start with a group-less consumer: records/s and MB/s each way.
* **weight refresh**: a trainer-sized object of ``--weight-mb`` MiB put once, then read ``--reads`` times
  the way a node refreshes (``ObjectStore.get_bytes``, with the node's credential when secured):
  the median seconds and MB/s of a read.

The two modes alternate ``--repeats`` times (a shared machine's load moves between them); each figure is
the median over the repeats. Prints ONE JSON line last, with the secured / plaintext ratios.

    python benchmarks/secure_overhead.py [--records 4000] [--size 16384] [--weight-mb 64] [--reads 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _cluster(state_dir: str, role: str | None):
    from astraflow.config import ClusterConfig
    from astraflow.security.material import SecureMaterial

    env = {"ASTRAFLOW_STATE_DIR": state_dir, "ASTRAFLOW_RUN": "bench"}
    if role is not None:
        env["ASTRAFLOW_CREDENTIALS_FILE"] = str(SecureMaterial(state_dir).credentials_file(role))
    return ClusterConfig.load(env=env).resolve()


def _log(cfg, records: int, size: int) -> dict:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    payload = os.urandom(size)
    producer = KafkaProducer(**cfg.kafka.client_kwargs(), acks="all", linger_ms=5, batch_size=512 * 1024,
                             max_request_size=4 * 1024 * 1024)
    producer.send("bench", payload, partition=0).get(timeout=30)  # topic created, connections open
    t0 = time.perf_counter()
    for _ in range(records):
        producer.send("bench", payload, partition=0)
    producer.flush()
    produce_s = time.perf_counter() - t0
    producer.close()
    consumer = KafkaConsumer(**cfg.kafka.client_kwargs(), enable_auto_commit=False, fetch_max_wait_ms=20,
                             max_partition_fetch_bytes=4 * 1024 * 1024)
    tp = TopicPartition("bench", 0)
    consumer.assign([tp])
    consumer.seek(tp, 1)
    got, t0 = 0, time.perf_counter()
    while got < records and time.perf_counter() - t0 < 120:
        got += sum(len(batch) for batch in consumer.poll(timeout_ms=500, max_records=5000).values())
    consume_s = time.perf_counter() - t0
    consumer.close()
    mb = records * size / 1e6
    return {"produce_records_s": round(records / produce_s), "produce_mb_s": round(mb / produce_s, 1),
            "consume_records_s": round(got / consume_s), "consume_mb_s": round(got * size / 1e6 / consume_s, 1),
            "consumed": got}


def _refresh(writer_cfg, reader_cfg, weight_mb: int, reads: int) -> dict:
    from astraflow.objstore import ObjectStore, RunLayout

    key = RunLayout("bench").anchor_key("policy", 1)
    blob = os.urandom(weight_mb * 1024 * 1024)
    ObjectStore.from_config(writer_cfg).put_bytes(key, blob)
    reader = ObjectStore.from_config(reader_cfg)
    seconds = []
    for _ in range(reads):
        t0 = time.perf_counter()
        assert len(reader.get_bytes(key)) == len(blob)
        seconds.append(time.perf_counter() - t0)
    median = statistics.median(seconds)
    return {"read_s": round(median, 3), "read_mb_s": round(len(blob) / 1e6 / median, 1)}


def _measure(secure: bool, args: argparse.Namespace) -> dict:
    from astraflow.embedded import EmbeddedStack

    with tempfile.TemporaryDirectory(prefix="secure-bench-") as state_dir:
        stack, result = EmbeddedStack.start_private(state_dir, storage="memory", secure=secure)
        try:
            writer = _cluster(state_dir, "trainer" if secure else None)
            reader = _cluster(state_dir, "node" if secure else None)
            return {"start_s": round(sum(result.seconds.values()), 2), "log": _log(reader, args.records, args.size),
                    "weight_refresh": _refresh(writer, reader, args.weight_mb, args.reads)}
        finally:
            stack.down()


def _medians(runs: list[dict]) -> dict:
    return {part: {k: statistics.median(run[part][k] for run in runs) for k in runs[0][part]}
            for part in ("log", "weight_refresh")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--size", type=int, default=16384)
    parser.add_argument("--weight-mb", type=int, default=64)
    parser.add_argument("--reads", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"plaintext": [], "secured": []}
    for _ in range(args.repeats):
        for mode, done in runs.items():
            done.append(_measure(mode == "secured", args))
            print(json.dumps({mode: done[-1]}), flush=True)
    plain, secured = _medians(runs["plaintext"]), _medians(runs["secured"])
    ratio = {f"{part}.{k}": round(secured[part][k] / plain[part][k], 3)
             for part in ("log", "weight_refresh") for k in plain[part] if k != "consumed"}
    print(json.dumps({"benchmark": "secure_overhead", "records": args.records, "size": args.size,
                      "weight_mb": args.weight_mb, "repeats": args.repeats, "plaintext": plain, "secured": secured,
                      "secured_over_plaintext": ratio}))


if __name__ == "__main__":
    main()
