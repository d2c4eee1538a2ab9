"""A secured stack's bucket, on the real SeaweedFS behind the real TLS terminator (docs/security.md):
HTTPS with the cluster's CA, one identity per role, and a node's key that cannot change the model."""

from __future__ import annotations

import hashlib
import socket
import ssl
import urllib.parse
import urllib.request

import pytest

from astraflow.delta.store import WeightStore
from astraflow.objstore import ObjectStore, RunLayout
from astraflow.objstore.errors import ObjectStoreError, ObjectStoreUnavailableError
from astraflow.security.pki import make_ca

pytestmark = pytest.mark.integration


def _denied(call, secret: str = "") -> str:
    with pytest.raises(ObjectStoreError) as refused:
        call()
    assert "AccessDenied" in str(refused.value), refused.value
    assert not secret or secret not in str(refused.value)
    return str(refused.value)


def _published(store: ObjectStore, layout: RunLayout) -> dict[str, bytes]:
    """A version of policy ``pi`` as a trainer leaves it: anchor, delta, manifest, checkpoint."""
    objects = {layout.anchor_key("pi", 12): b"anchor-bytes" * 100, layout.delta_key("pi", 13): b"delta" * 50,
               layout.manifest_key("pi", 13): b'{"version": 13}', layout.trainer_key("pi", "latest.json"): b'{"step": 13}'}
    for key, data in objects.items():
        store.put_bytes(key, data)
    return objects


def test_a_node_key_cannot_put_overwrite_or_delete_what_decides_the_model(secure_role):
    trainer_cfg, node_cfg = secure_role("trainer"), secure_role("node")
    assert trainer_cfg.s3.endpoint.startswith("https://") and node_cfg.s3.access_key != trainer_cfg.s3.access_key
    trainer, node = ObjectStore.from_config(trainer_cfg), ObjectStore.from_config(node_cfg)
    layout = RunLayout(node_cfg.run)
    published = _published(trainer, layout)
    before = {key: hashlib.sha256(trainer.get_bytes(key)).hexdigest() for key in published}

    for key in published:
        _denied(lambda key=key: node.put_bytes(key, b"poisoned"), node_cfg.s3.secret_key)  # overwrite
        _denied(lambda key=key: node.delete(key), node_cfg.s3.secret_key)
    for key in (layout.anchor_key("pi", 14), layout.delta_key("pi", 14), layout.trainer_key("pi", "step-14/model.pt")):
        _denied(lambda key=key: node.put_bytes(key, b"forged"))  # a new version or checkpoint
    _denied(lambda: node.put_bytes(layout.manifest_key("pi", 14), b"{}", if_none_match=True))
    assert {key: hashlib.sha256(trainer.get_bytes(key)).hexdigest() for key in published} == before
    assert not trainer.exists(layout.manifest_key("pi", 14))

    # What a node does need: read the weights, list versions, register as a subscriber, put a claim.
    assert node.get_bytes(layout.manifest_key("pi", 13)) == published[layout.manifest_key("pi", 13)]
    assert len(list(node.list(layout.weights_prefix("pi")))) >= 3
    weights = WeightStore(node, node_cfg.run, "pi")
    weights.register_subscriber("node-1", 13)
    assert [s.version for s in WeightStore(trainer, node_cfg.run, "pi").subscribers()] == [13]
    weights.unregister_subscriber("node-1")
    node.put_bytes(layout.claim_key("a" * 64), b"large trajectory")

    # The trainer may replace its own objects (a GC deletes old versions).
    trainer.delete(layout.delta_key("pi", 13))


def test_each_role_writes_only_its_prefixes(secure_role):
    layout = RunLayout(secure_role("reader").run)
    stores = {role: ObjectStore.from_config(secure_role(role)) for role in ("dataflow", "archiver", "reader")}
    stores["dataflow"].put_json(layout.dataflow_key("state.json"), {"ok": 1})
    stores["archiver"].put_bytes(layout.archive_prefix("metrics") + "part-0.parquet", b"PAR1")
    _denied(lambda: stores["dataflow"].put_bytes(layout.anchor_key("pi", 1), b"x"))
    _denied(lambda: stores["archiver"].put_bytes(layout.trainer_key("pi", "latest.json"), b"x"))
    _denied(lambda: stores["reader"].put_bytes(layout.claim_key("b" * 64), b"x"))
    assert stores["reader"].get_json(layout.dataflow_key("state.json")) == {"ok": 1}


def test_the_bucket_speaks_https_only_and_refuses_bad_keys_and_other_cas(secure_role, tmp_path):
    cfg = secure_role("reader")
    https = cfg.s3.endpoint
    with pytest.raises(Exception, match="(?i)closed|reset|remote end|ssl|http"):
        urllib.request.urlopen(https.replace("https://", "http://") + "/", timeout=5)  # plaintext to the TLS port

    other_ca = tmp_path / "other-ca.pem"
    other_ca.write_bytes(make_ca("someone else").cert_pem)
    stranger = cfg.model_copy(update={"s3": cfg.s3.model_copy(update={"ca_file": str(other_ca)})})
    with pytest.raises(ObjectStoreError, match="TLS handshake .* failed.*s3.ca_file") as untrusted:
        ObjectStore.from_config(stranger, max_attempts=1, check_bucket=False).exists("x")
    assert not isinstance(untrusted.value, ObjectStoreUnavailableError)  # waiting cannot cure it
    url = urllib.parse.urlsplit(https)
    with pytest.raises(ssl.SSLCertVerificationError), socket.create_connection((url.hostname, url.port), 5) as sock:
        ssl.create_default_context(cafile=str(other_ca)).wrap_socket(sock, server_hostname=url.hostname)

    for access, secret, code in ((cfg.s3.access_key, "wrong-secret", "SignatureDoesNotMatch"),
                                 ("AFNOBODY", "x" * 40, "InvalidAccessKeyId")):
        bad = cfg.model_copy(update={"s3": cfg.s3.model_copy(update={"access_key": access, "secret_key": secret})})
        with pytest.raises(ObjectStoreError, match=code) as refused:
            ObjectStore.from_config(bad, max_attempts=1, check_bucket=False).get_bytes("x")
        assert secret not in str(refused.value) and cfg.s3.secret_key not in str(refused.value)


def test_a_reader_replays_the_archive_over_https_with_duckdb_and_polars(secure_role, tmp_path, monkeypatch):
    """The archive readers (astraflow.archive.readers) take the cluster's CA: a ``reader`` key reads an
    archived part from the secured bucket; DuckDB verifies the certificate (another CA is refused)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    from astraflow.archive.readers import archive_url, duckdb_connect, polars_storage_options

    archiver, reader = secure_role("archiver"), secure_role("reader")
    part = io.BytesIO()
    pq.write_table(pa.table({"step": [1, 2, 3]}), part)
    ObjectStore.from_config(archiver).put_bytes(RunLayout(reader.run).archive_prefix("metrics") + "part-0.parquet",
                                                part.getvalue())
    url = archive_url(reader, "metrics")
    assert duckdb_connect(reader).execute(f"SELECT sum(step) FROM read_parquet('{url}')").fetchone() == (6,)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # polars_storage_options sets it for this process
    assert pl.scan_parquet(url, storage_options=polars_storage_options(reader)).select(pl.col("step").sum()).collect().item() == 6

    other_ca = tmp_path / "other-ca.pem"
    other_ca.write_bytes(make_ca("someone else").cert_pem)
    stranger = reader.model_copy(update={"s3": reader.s3.model_copy(update={"ca_file": str(other_ca)})})
    with pytest.raises(duckdb.Error, match="(?i)ssl|certificate|verif|http"):
        duckdb_connect(stranger).execute(f"SELECT count(*) FROM read_parquet('{url}')").fetchone()


def test_a_policy_trainer_key_cannot_touch_another_policys_weights_or_checkpoints(secure_stack, secure_role, tmp_path):
    """`astraflow credentials issue trainer --policy pi`: a key the running S3 server takes at once (SIGHUP),
    scoped to pi's versions and checkpoints."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from astraflow.config import ClusterConfig

    out = tmp_path / "trainer-pi.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    issued = subprocess.run([str(Path(sys.executable).with_name("astraflow")), "credentials", "issue", "trainer",
                             "--policy", "pi", "--out", str(out), "--state-dir", str(secure_stack.state_dir)],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert issued.returncode == 0, issued.stderr
    run = secure_role("reader").run
    pi_cfg = ClusterConfig.load(out, env={"ASTRAFLOW_STATE_DIR": str(tmp_path / "remote"), "ASTRAFLOW_RUN": run})
    assert pi_cfg.role == "trainer-pi"
    pi = ObjectStore.from_config(pi_cfg)
    layout = RunLayout(run)
    ref_objects = _published(ObjectStore.from_config(secure_role("trainer")), layout)  # policy `pi` there: rename
    ref_keys = [key.replace("/pi/", "/ref/") for key in ref_objects]
    admin = ObjectStore.from_config(secure_role("admin"))
    for key, data in zip(ref_keys, ref_objects.values(), strict=True):
        admin.put_bytes(key, data)
    before = {key: hashlib.sha256(admin.get_bytes(key)).hexdigest() for key in ref_keys}

    pi.put_bytes(layout.anchor_key("pi", 20), b"pi's own anchor")  # its own policy: allowed
    pi.put_bytes(layout.trainer_key("pi", "latest.json"), b'{"step": 20}')
    pi.delete(layout.delta_key("pi", 13))
    for key in ref_keys:
        _denied(lambda key=key: pi.put_bytes(key, b"poisoned"), pi_cfg.s3.secret_key)
        _denied(lambda key=key: pi.delete(key))
    _denied(lambda: pi.put_bytes(layout.manifest_key("ref", 14), b"{}"))
    assert {key: hashlib.sha256(admin.get_bytes(key)).hexdigest() for key in ref_keys} == before
    assert "trainer-pi" in (secure_stack.state_dir / "secure" / "s3-identities.json").read_text()


def test_what_a_node_key_may_write_under_weights_publishes_no_version(secure_role):
    """The node's `*/weights/*/subscribers/*` also matches a key nested in a version's folder (`*` spans
    slashes on the server): the bucket takes it, and the weight store does not count it as a version."""
    trainer_cfg, node_cfg = secure_role("trainer"), secure_role("node")
    trainer, node = ObjectStore.from_config(trainer_cfg), ObjectStore.from_config(node_cfg)
    layout = RunLayout(node_cfg.run)
    _published(trainer, layout)
    nested = layout.version_prefix("pi", 99) + "subscribers/manifest.json"
    node.put_bytes(nested, b'{"version": 99}')  # allowed by the server: the pattern's limit, not a refusal
    _denied(lambda: node.put_bytes(layout.manifest_key("pi", 99), b'{"version": 99}'))
    assert WeightStore(node, node_cfg.run, "pi").versions() == [13]
