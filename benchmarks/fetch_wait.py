"""Send -> poll latency of one record against the consumer's ``fetch_max_wait_ms``, on the embedded broker.

One producer (acks=all, no linger) sends a small record at random intervals (50-120 ms, so a record
usually arrives while the consumer's fetch is held); one group consumer polls in a loop on a thread
of its own and records its poll time minus the record's timestamp. Each wait runs on a topic of its
own, on one private embedded stack. What it answers: does the broker answer a held fetch when a record
arrives, or only when the wait ends? With a full hold the p50 would be about half the wait.

Prints one JSON line last: per wait, p50 / p90 / max in ms, and ``p50_share_of_wait``.

    python benchmarks/fetch_wait.py [--waits 5,20,100,500] [--records 60] [--log-storage memory]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path


def measure(kafka_kwargs: dict, wait_ms: int, records: int, seed: int) -> dict:
    from kafka import KafkaConsumer, KafkaProducer

    topic = f"fetch-wait-{wait_ms}-{uuid.uuid4().hex[:6]}"
    producer = KafkaProducer(**kafka_kwargs, linger_ms=0, acks="all")
    producer.send(topic, b"warm-up").get(10)  # creates the topic
    consumer = KafkaConsumer(topic, **kafka_kwargs, group_id=f"g-{topic}", auto_offset_reset="earliest",
                             fetch_max_wait_ms=wait_ms, session_timeout_ms=6000, heartbeat_interval_ms=1000)
    while not consumer.assignment():  # the group join stays outside the measurement
        consumer.poll(timeout_ms=100)
    latencies: list[float] = []
    done = threading.Event()

    def consume() -> None:
        while not done.is_set():
            for batch in consumer.poll(timeout_ms=200).values():
                latencies.extend(time.time() * 1000 - r.timestamp for r in batch if r.value != b"warm-up")

    reader = threading.Thread(target=consume, name="fetch-wait-consumer")
    reader.start()
    rng = random.Random(seed)
    try:
        for _ in range(records):
            time.sleep(rng.uniform(0.05, 0.12))
            producer.send(topic, b"x").get(10)
        deadline = time.monotonic() + 5 + wait_ms / 1000
        while len(latencies) < records and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        reader.join()
        consumer.close()
        producer.close()
    if len(latencies) < records:
        raise RuntimeError(f"fetch_max_wait_ms={wait_ms}: {len(latencies)}/{records} records arrived")
    ordered = sorted(latencies)
    p50 = statistics.median(ordered)
    return {"fetch_max_wait_ms": wait_ms, "n": len(ordered), "p50_ms": round(p50, 1),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 1), "max_ms": round(ordered[-1], 1),
            "p50_share_of_wait": round(p50 / wait_ms, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waits", default="5,20,100,500", help="fetch_max_wait_ms values, comma-separated")
    ap.add_argument("--records", type=int, default=60, help="records per wait (default 60)")
    ap.add_argument("--log-storage", choices=["memory", "s3"], default="memory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    waits = [int(w) for w in args.waits.split(",") if w.strip()]

    from astraflow.config import ClusterConfig
    from astraflow.embedded import EmbeddedStack

    results = []
    with tempfile.TemporaryDirectory(prefix="af-fetch-wait-") as tmp:
        stack, _ = EmbeddedStack.start_private(Path(tmp) / "stack", storage=args.log_storage)
        try:
            cfg = ClusterConfig(state_dir=Path(tmp) / "stack").resolve()
            for wait in waits:
                results.append(measure(cfg.kafka.client_kwargs(), wait, args.records, args.seed))
                print(f"  fetch_max_wait_ms {wait}: {results[-1]}", file=sys.stderr, flush=True)
        finally:
            stack.down()
    print(json.dumps({"benchmark": "fetch_wait", "log_storage": args.log_storage, "records": args.records,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
