"""The embedded stack and the session fixtures, against real processes."""

from __future__ import annotations

import boto3
from kafka import KafkaConsumer, KafkaProducer


def _s3(cfg):
    return boto3.client("s3", endpoint_url=cfg.s3.endpoint, aws_access_key_id=cfg.s3.access_key,
                        aws_secret_access_key=cfg.s3.secret_key, region_name=cfg.s3.region)


def test_fixture_cluster_is_real_kafka_and_s3(test_cluster, unique_name):
    topic = f"{test_cluster.run}.smoke"
    producer = KafkaProducer(**test_cluster.kafka.client_kwargs())
    for i in range(5):
        producer.send(topic, key=b"k", value=f"v{i}".encode())
    producer.flush()
    producer.close()
    consumer = KafkaConsumer(topic, group_id=unique_name("group"), auto_offset_reset="earliest",
                             consumer_timeout_ms=10000, session_timeout_ms=6000,
                             **test_cluster.kafka.client_kwargs())
    values = []
    for msg in consumer:
        values.append(msg.value)
        if len(values) == 5:
            break
    consumer.close()
    assert values == [f"v{i}".encode() for i in range(5)]

    s3 = _s3(test_cluster)
    key = f"{test_cluster.run}/smoke.bin"
    s3.put_object(Bucket=test_cluster.s3.bucket, Key=key, Body=b"hello")
    assert s3.get_object(Bucket=test_cluster.s3.bucket, Key=key)["Body"].read() == b"hello"


def test_unique_names_differ(test_cluster, unique_name, cluster):
    assert unique_name("g") != unique_name("g")
    assert test_cluster.run != cluster.run and test_cluster.run.startswith("test_unique_names_differ-")
