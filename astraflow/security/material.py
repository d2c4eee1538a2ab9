"""The secrets of a secured embedded stack, under ``<state_dir>/secure/`` (directory 0700, files 0600).

```
ca.pem ca.key                 the cluster's CA (:mod:`astraflow.security.pki`)
server.pem server.key         the TLS listeners' certificate (the advertised host, 127.0.0.1, localhost)
clients/<role>.pem .key       one client certificate per role: the log admits a client by it
roles.json                    one S3 key pair per role
s3-identities.json            the S3 server's identities: each role's key with its actions (roles.py)
credentials/<role>.yaml       a role's credential as a cluster-config fragment naming the files above
```

Generated once and kept (a later ``up --secure`` reuses them; the server certificate is re-issued when
the advertised host changes). ``credential_file`` writes a role's one-file credential for another
machine, with the certificates and keys inline.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from astraflow.security.pki import KeyPair, issue_client, issue_server, make_ca
from astraflow.security.roles import POLICY_TRAINER, ROLES, policy_trainer, s3_actions

SECURE_DIR = "secure"


def write_private(path: Path, data: bytes | str) -> Path:
    """``data`` in ``path``, mode 0600 from the start (never readable by others, even for a moment)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)
    return path


class SecureMaterial:
    """The CA, certificates and role credentials of the stack under ``state_dir``."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir).absolute() / SECURE_DIR

    @property
    def ca_file(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def server_cert_file(self) -> Path:
        return self.dir / "server.pem"

    @property
    def server_key_file(self) -> Path:
        return self.dir / "server.key"

    @property
    def identities_file(self) -> Path:
        return self.dir / "s3-identities.json"

    def credentials_file(self, role: str) -> Path:
        return self.dir / "credentials" / f"{role}.yaml"

    def _client_files(self, role: str) -> tuple[Path, Path]:
        return self.dir / "clients" / f"{role}.pem", self.dir / "clients" / f"{role}.key"

    # -- generation --------------------------------------------------------------------------------
    def ensure(self, hosts: list[str], bucket: str, log_bucket: str) -> None:
        """Create whatever is missing: the CA, a server certificate valid for ``hosts``, each role's
        client certificate and S3 keys, the S3 identities and the credential files."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dir.chmod(0o700)
        ca = self._ca()
        hosts_file = self.dir / "server-hosts.json"
        if not self.server_cert_file.exists() or json.loads(hosts_file.read_text()) != hosts:
            server = issue_server(ca, hosts)
            write_private(self.server_key_file, server.key_pem)
            write_private(self.server_cert_file, server.cert_pem)
            write_private(hosts_file, json.dumps(hosts))
        self._issue(ca, ROLES, bucket, log_bucket)

    def ensure_policy_trainers(self, policies: list[str], bucket: str, log_bucket: str) -> list[str]:
        """A trainer identity per policy (``trainer-<policy>``: its certificate, S3 keys and credential
        file), scoped to that policy's prefixes; returns the identities it added (the S3 server reads its
        identities file again on SIGHUP)."""
        keys = self.s3_keys()
        added = [policy_trainer(p) for p in policies if policy_trainer(p) not in keys]
        if added:
            self._issue(self._ca(), added, bucket, log_bucket)
        return added

    def _issue(self, ca: KeyPair, identities: Sequence[str], bucket: str, log_bucket: str) -> None:
        """Client certificates, S3 keys and credential files of ``identities`` (kept where they exist),
        then the S3 server's identities file with every identity this stack has."""
        keys = self.s3_keys(identities)
        for identity in identities:
            cert_file, key_file = self._client_files(identity)
            if not cert_file.exists():
                client = issue_client(ca, identity)
                write_private(key_file, client.key_pem)
                write_private(cert_file, client.cert_pem)
            write_private(self.credentials_file(identity),
                          yaml.safe_dump(self._local_credential(identity, keys[identity])))
        everyone = [*ROLES, *sorted(k for k in keys if k.startswith(POLICY_TRAINER))]
        entries = [{"name": name, "credentials": [{"accessKey": keys[name]["access_key"],
                                                   "secretKey": keys[name]["secret_key"]}],
                    "actions": s3_actions(name, bucket, log_bucket)} for name in everyone]
        write_private(self.identities_file, json.dumps({"identities": entries}, indent=1))

    def _ca(self) -> KeyPair:
        key_file = self.dir / "ca.key"
        if not self.ca_file.exists():
            ca = make_ca()
            write_private(key_file, ca.key_pem)
            write_private(self.ca_file, ca.cert_pem)
        return KeyPair(self.ca_file.read_bytes(), key_file.read_bytes())

    def s3_keys(self, identities: Sequence[str] = ROLES) -> dict[str, dict[str, str]]:
        """``{identity: {"access_key", "secret_key"}}`` of every identity kept, ``identities``' generated
        on first use."""
        path = self.dir / "roles.json"
        keys = json.loads(path.read_text()) if path.exists() else {}
        missing = [identity for identity in identities if identity not in keys]
        for identity in missing:
            tag = identity.upper().replace("-", "").replace("_", "")[:12]
            keys[identity] = {"access_key": f"AF{tag}{secrets.token_hex(6).upper()}",
                              "secret_key": secrets.token_urlsafe(30)}
        if missing:
            write_private(path, json.dumps(keys))
        return keys

    def client_tls(self, role: str) -> dict[str, str]:
        """kafka-python's TLS settings for ``role`` on this machine."""
        cert_file, key_file = self._client_files(role)
        return {"security_protocol": "SSL", "ssl_cafile": str(self.ca_file),
                "ssl_certfile": str(cert_file), "ssl_keyfile": str(key_file)}

    def _local_credential(self, role: str, keys: dict[str, str]) -> dict[str, Any]:
        """The credential of ``role`` on this machine: files by path, no endpoint (the stack's
        ``stack.json`` has them)."""
        return {"role": role, "kafka": self.client_tls(role), "s3": {**keys, "ca_file": str(self.ca_file)}}

    # -- one file for another machine --------------------------------------------------------------
    def credential_file(self, role: str, kafka_bootstrap: str, s3_endpoint: str, bucket: str,
                        fetch_max_wait_ms: int | None = None) -> dict[str, Any]:
        """``role``'s whole credential as a cluster config: the endpoints, the CA, its client
        certificate and key and its S3 keys inline (``astraflow credentials issue``).
        ``fetch_max_wait_ms``: the embedded broker's (a config with a bootstrap of its own would take
        kafka-python's 500 ms, which Tansu holds for half: every hand-off to the node ~250 ms later)."""
        cert_file, key_file = self._client_files(role)
        keys = self.s3_keys()[role]
        wait = {} if fetch_max_wait_ms is None else {"fetch_max_wait_ms": fetch_max_wait_ms}
        return {"role": role,
                "kafka": {"bootstrap": kafka_bootstrap, "security_protocol": "SSL", **wait,
                          "ssl_ca_pem": self.ca_file.read_text(), "ssl_cert_pem": cert_file.read_text(),
                          "ssl_key_pem": key_file.read_text()},
                "s3": {"endpoint": s3_endpoint, "bucket": bucket, **keys, "ca_pem": self.ca_file.read_text()}}
