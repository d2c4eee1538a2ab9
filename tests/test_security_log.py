"""A secured stack's log, on the real Tansu behind the real TLS terminator (docs/security.md): mutual TLS
admits a role's certificate, and refuses a plaintext client, a client without a certificate, one with
a certificate of another CA and one that does not trust the broker, each with an error naming the cause."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer

from astraflow.config import ClusterConfig
from astraflow.log.admin import open_admin
from astraflow.log.errors import BrokerRefusedError
from astraflow.security.pki import issue_client, make_ca

pytestmark = pytest.mark.integration


def _with_kafka(cfg: ClusterConfig, **update) -> ClusterConfig:
    return cfg.model_copy(update={"kafka": cfg.kafka.model_copy(update=update)})


def test_a_role_certificate_produces_and_consumes_through_tls(secure_role, unique_name):
    cfg = secure_role("node")
    assert cfg.kafka.security_protocol == "SSL" and cfg.kafka.ssl_certfile
    topic = unique_name("tls")
    producer = KafkaProducer(**cfg.kafka.client_kwargs())
    producer.send(topic, b"over tls").get(timeout=20)
    producer.close()
    consumer = KafkaConsumer(topic, **cfg.kafka.client_kwargs(), auto_offset_reset="earliest", consumer_timeout_ms=10_000)
    assert next(consumer).value == b"over tls"
    consumer.close()


def test_the_broker_refuses_wrong_credentials_naming_the_cause(secure_role, tmp_path):
    cfg = secure_role("node")
    stranger_ca = make_ca("someone else")
    forged = issue_client(stranger_ca, "node")
    (tmp_path / "forged.pem").write_bytes(forged.cert_pem)
    (tmp_path / "forged.key").write_bytes(forged.key_pem)
    (tmp_path / "stranger-ca.pem").write_bytes(stranger_ca.cert_pem)
    cases = {
        "speaks TLS and this client does not": _with_kafka(cfg, security_protocol="PLAINTEXT", ssl_cafile=None,
                                                           ssl_certfile=None, ssl_keyfile=None),
        "requires a client certificate": _with_kafka(cfg, ssl_certfile=None, ssl_keyfile=None),
        "refused this client's certificate": _with_kafka(cfg, ssl_certfile=str(tmp_path / "forged.pem"),
                                                         ssl_keyfile=str(tmp_path / "forged.key")),
        "does not trust": _with_kafka(cfg, ssl_cafile=str(tmp_path / "stranger-ca.pem")),
    }
    for cause, bad in cases.items():
        with pytest.raises(BrokerRefusedError, match=cause) as refused:
            open_admin(bad, timeout_s=2)
        assert cfg.s3.secret_key not in str(refused.value)


def test_a_node_without_its_certificate_exits_with_the_cause(secure_stack, tmp_path):
    """What docs/security.md promises a component: a refusal waiting cannot cure ends it with status 1
    and one line naming the cause (its supervisor, if any, then restarts it within its budget)."""
    import subprocess
    import sys

    import yaml

    from astraflow.security.material import SecureMaterial

    issued = SecureMaterial(secure_stack.state_dir).credential_file("node", secure_stack.kafka_bootstrap,
                                                                    secure_stack.s3_endpoint, "astraflow")
    del issued["kafka"]["ssl_cert_pem"], issued["kafka"]["ssl_key_pem"]
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(issued))
    recipe = str(Path(__file__).parent.parent / "examples" / "recipes" / "math.yaml")
    node = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "node", "--cluster", "node.yaml", "--recipe",
                           recipe, "--run-id", "refused"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False, env={k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")})
    assert node.returncode == 1, node.stderr[-2000:]
    assert "requires a client certificate and this client has none" in node.stderr.splitlines()[-1]
    assert "Traceback" not in node.stderr
