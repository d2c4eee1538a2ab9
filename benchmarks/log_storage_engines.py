"""What Tansu's log storage engines cost: ``memory`` (fast, lost at down) vs ``s3`` (durable, in the
embedded SeaweedFS), side by side in one run.

For each engine: start the embedded stack in a temp state dir on free ports (start-up seconds),
produce N records of 64 KiB through kafka-python with acks=all (MB/s), consume them all back from
the beginning without a consumer group (MB/s, first-fetch latency). For ``s3`` also: down, up, and
time to read everything back (durability is checked, not assumed). Prints ONE JSON line last.

    python benchmarks/log_storage_engines.py [--records 300] [--size 65536]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def _produce(bootstrap: str, topic: str, payloads: list[bytes]) -> float:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=[bootstrap])
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all", linger_ms=5,
                             max_request_size=2 * 1024 * 1024, batch_size=256 * 1024)
    t0 = time.perf_counter()
    futures = [producer.send(topic, key=str(i).encode(), value=p) for i, p in enumerate(payloads)]
    producer.flush()
    for f in futures:
        f.get(timeout=60)
    seconds = time.perf_counter() - t0
    producer.close()
    return seconds


def _consume(bootstrap: str, topic: str, expected: list[bytes]) -> tuple[float, float]:
    """Seconds to read every record back (checked byte for byte), and seconds to the first one."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=[bootstrap], enable_auto_commit=False,
                             fetch_max_bytes=16 * 1024 * 1024, max_partition_fetch_bytes=8 * 1024 * 1024)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    got: list[bytes] = []
    first = None
    t0 = time.perf_counter()
    deadline = t0 + 300
    while len(got) < len(expected) and time.perf_counter() < deadline:
        for records in consumer.poll(timeout_ms=500, max_records=1000).values():
            if first is None:
                first = time.perf_counter() - t0
            got.extend(r.value for r in records)
    seconds = time.perf_counter() - t0
    consumer.close()
    if got[: len(expected)] != expected:
        raise SystemExit(f"{topic}: read back {len(got)} records, expected {len(expected)} identical ones")
    return seconds, first or seconds


def bench_engine(storage: str, payloads: list[bytes]) -> dict:
    from astraflow.embedded import EmbeddedStack, StackPorts

    mb = sum(len(p) for p in payloads) / 1e6
    with tempfile.TemporaryDirectory(prefix=f"bench-{storage}-") as state:
        stack = EmbeddedStack(state, StackPorts.free(), storage=storage, die_with_parent=True)
        try:
            t0 = time.perf_counter()
            up = stack.up()
            startup = time.perf_counter() - t0
            bootstrap = up.endpoints["kafka_bootstrap"]
            produce_s = _produce(bootstrap, "bench", payloads)
            consume_s, first_s = _consume(bootstrap, "bench", payloads)
            result = {
                "startup_s": round(startup, 2),
                "startup_kafka_s": up.seconds.get("kafka"),
                "produce_s": round(produce_s, 2),
                "produce_MBps": round(mb / produce_s, 1),
                "consume_s": round(consume_s, 2),
                "consume_MBps": round(mb / consume_s, 1),
                "first_fetch_s": round(first_s, 3),
            }
            if storage == "s3":
                stack.down()
                stack = EmbeddedStack(state, StackPorts.free(), storage=storage, die_with_parent=True)
                t0 = time.perf_counter()
                bootstrap = stack.up().endpoints["kafka_bootstrap"]
                result["restart_s"] = round(time.perf_counter() - t0, 2)
                reread_s, _ = _consume(bootstrap, "bench", payloads)
                result["reread_after_restart_s"] = round(reread_s, 2)
                result["durable"] = True  # _consume exits non-zero if anything was lost
            else:
                result["durable"] = False
            du = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(state) for f in fs)
            result["state_dir_MB"] = round(du / 1e6, 1)
            return result
        finally:
            stack.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--size", type=int, default=64 * 1024, help="bytes per record")
    args = parser.parse_args()
    try:
        import crc32c  # noqa: F401
        crc = "crc32c"
    except ImportError:
        crc = "pure-python (install crc32c)"
    payloads = [os.urandom(args.size) for _ in range(args.records)]
    results = {}
    for storage in ("memory", "s3"):
        results[storage] = bench_engine(storage, payloads)
        print(f"{storage}: {results[storage]}", file=sys.stderr)
    m, s = results["memory"], results["s3"]
    print(json.dumps({
        "benchmark": "log_storage_engines",
        "records": args.records,
        "record_bytes": args.size,
        "total_MB": round(args.records * args.size / 1e6, 1),
        "kafka_crc": crc,
        "cpus": os.cpu_count(),
        "memory": m,
        "s3": s,
        "s3_vs_memory": {
            "produce_slowdown": round(s["produce_s"] / m["produce_s"], 2),
            "consume_slowdown": round(s["consume_s"] / m["consume_s"], 2),
        },
    }))


if __name__ == "__main__":
    main()
