"""The cluster config: YAML + ASTRAFLOW_* overlay, readable validation errors, fail-fast resolve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astraflow.config import STACK_FILE, ClusterConfig, ConfigError, KafkaSettings


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_yaml_then_environment_overlay(tmp_path):
    path = _yaml(tmp_path, """
run: exp1
kafka:
  bootstrap: kafka-a:9092,kafka-b:9092
  security_protocol: SASL_SSL
s3:
  endpoint: https://s3.eu-west-1.amazonaws.com
  bucket: rl-runs
inline_limit_bytes: 500000
""")
    env = {"ASTRAFLOW_RUN": "exp2", "ASTRAFLOW_S3_BUCKET": "other", "ASTRAFLOW_KAFKA_SASL_USERNAME": "u",
           "ASTRAFLOW_INLINE_LIMIT_BYTES": "1000"}
    cfg = ClusterConfig.load(path, env=env)
    assert cfg.run == "exp2"  # the environment wins
    assert cfg.s3.bucket == "other"
    assert cfg.s3.endpoint == "https://s3.eu-west-1.amazonaws.com"  # kept from YAML
    assert cfg.kafka.bootstrap == "kafka-a:9092,kafka-b:9092"
    assert cfg.kafka.sasl_username == "u"
    assert cfg.inline_limit_bytes == 1000
    assert not cfg.is_embedded


def test_config_path_from_environment(tmp_path):
    path = _yaml(tmp_path, "run: from-file\n")
    assert ClusterConfig.load(env={"ASTRAFLOW_CONFIG": str(path)}).run == "from-file"
    assert ClusterConfig.load(env={}).run == "default"


def test_unrelated_astraflow_variables_are_ignored():
    # The CLI and the test fixtures read their own ASTRAFLOW_* variables; the config must not choke.
    cfg = ClusterConfig.load(env={"ASTRAFLOW_KAFKA_PORT": "1", "ASTRAFLOW_LOG_STORAGE": "memory",
                                  "ASTRAFLOW_TEST_STACK": "embedded"})
    assert cfg.kafka.bootstrap is None


@pytest.mark.parametrize(
    "text, env, words",
    [
        ("run: 'has space'\n", {}, ["run", "pattern"]),
        ("kafka:\n  bootstrapp: x:1\n", {}, ["kafka.bootstrapp", "Extra inputs"]),
        ("kafka:\n  security_protocol: TLS\n", {}, ["security_protocol", "SASL_SSL"]),
        ("", {"ASTRAFLOW_INLINE_LIMIT_BYTES": "lots"}, ["inline_limit_bytes", "integer"]),
        ("inline_limit_bytes: 0\n", {}, ["inline_limit_bytes", "greater than 0"]),
    ],
)
def test_validation_errors_name_the_field_and_the_file(tmp_path, text, env, words):
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        ClusterConfig.load(path, env=env)
    message = str(err.value)
    assert str(path) in message
    for word in words:
        assert word in message, message
    assert "Traceback" not in message


@pytest.mark.parametrize(
    "text, words",
    [("kafka: [unclosed\n", ["not valid YAML"]), ("- a\n- b\n", ["must be a mapping", "list"])],
)
def test_bad_yaml_is_a_config_error(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        ClusterConfig.load(_yaml(tmp_path, text), env={})
    assert all(word in str(err.value) for word in words)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not found.*nope.yaml"):
        ClusterConfig.load(tmp_path / "nope.yaml", env={})


def test_resolve_fails_fast_naming_the_missing_endpoint(tmp_path):
    with pytest.raises(ConfigError) as both:
        ClusterConfig(state_dir=tmp_path).resolve()
    assert "Kafka bootstrap" in str(both.value) and "S3 endpoint" in str(both.value)
    assert "astraflow up" in str(both.value)

    only_s3_missing = ClusterConfig(state_dir=tmp_path, kafka={"bootstrap": "k:9092"})
    with pytest.raises(ConfigError) as err:
        only_s3_missing.resolve()
    assert "S3 endpoint" in str(err.value) and "ASTRAFLOW_S3_ENDPOINT" in str(err.value)
    assert "Kafka bootstrap" not in str(err.value)


def test_resolve_fills_unset_endpoints_from_stack_json(tmp_path):
    (tmp_path / STACK_FILE).write_text(json.dumps({
        "kafka_bootstrap": "127.0.0.1:19092", "s3_endpoint": "http://127.0.0.1:18333",
        "s3_access_key": "AK", "s3_secret_key": "SK", "s3_bucket": "astraflow",
    }))
    cfg = ClusterConfig(state_dir=tmp_path, run="r1").resolve()
    assert cfg.kafka.bootstrap == "127.0.0.1:19092"
    assert (cfg.s3.endpoint, cfg.s3.access_key, cfg.s3.secret_key) == ("http://127.0.0.1:18333", "AK", "SK")
    assert cfg.run == "r1"
    assert cfg.kafka.fetch_max_wait_ms == 100  # no log_storage recorded: the durable s3 default
    # A configured endpoint is never overridden by the embedded stack (nor its fetch wait chosen).
    mixed = ClusterConfig(state_dir=tmp_path, kafka={"bootstrap": "remote:9092"}).resolve()
    assert mixed.kafka.bootstrap == "remote:9092" and mixed.s3.endpoint == "http://127.0.0.1:18333"
    assert mixed.kafka.fetch_max_wait_ms is None
    stack = json.loads((tmp_path / STACK_FILE).read_text())
    (tmp_path / STACK_FILE).write_text(json.dumps({**stack, "log_storage": "memory"}))
    assert ClusterConfig(state_dir=tmp_path).resolve().kafka.fetch_max_wait_ms == 20
    chosen = ClusterConfig(state_dir=tmp_path, kafka={"fetch_max_wait_ms": 250}).resolve()
    assert chosen.kafka.fetch_max_wait_ms == 250
    # Fully external config: resolve() does not need a stack at all.
    external = ClusterConfig(state_dir=tmp_path / "none", kafka={"bootstrap": "k:1"}, s3={"endpoint": "http://s:1"})
    assert external.resolve() is external


def test_client_kwargs_pass_sasl_and_tls_through():
    kafka = KafkaSettings(
        bootstrap="a:9093,b:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
        sasl_username="user", sasl_password="secret", ssl_cafile="/etc/ca.pem",
        ssl_certfile="/etc/cert.pem", ssl_keyfile="/etc/key.pem",
    )
    assert kafka.client_kwargs() == {
        "bootstrap_servers": ["a:9093", "b:9093"],
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "user",
        "sasl_plain_password": "secret",
        "ssl_cafile": "/etc/ca.pem",
        "ssl_certfile": "/etc/cert.pem",
        "ssl_keyfile": "/etc/key.pem",
    }
    plain = KafkaSettings(bootstrap="k:9092").client_kwargs()
    assert plain == {"bootstrap_servers": ["k:9092"], "security_protocol": "PLAINTEXT"}
    # kafka-python accepts every key (a typo here would only show up against a real broker).
    from kafka import KafkaConsumer

    assert set(kafka.client_kwargs()) <= set(KafkaConsumer.DEFAULT_CONFIG)


def test_client_kwargs_need_a_resolved_bootstrap():
    with pytest.raises(ConfigError, match="resolve"):
        KafkaSettings().client_kwargs()


def test_resolved_config_from_the_session_cluster(cluster):
    # The fixture's config is a real, resolved one that components can take as is.
    assert cluster.kafka.bootstrap and cluster.s3.endpoint
    assert cluster.kafka.client_kwargs()["bootstrap_servers"]
