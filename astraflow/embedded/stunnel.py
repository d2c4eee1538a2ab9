"""The TLS terminator of a secured embedded stack: stunnel (Debian's ``stunnel4``) in front of both servers.

The embedded Tansu 0.6 cannot serve TLS (its ``--cert`` and ``--key`` refuse each other, and a
certificate alone leaves the listener plaintext) nor authenticate anyone (its object-store engine keeps
no SCRAM credentials: an upsert is a no-op, so ``--authentication`` admits no client). So Tansu and
SeaweedFS's S3 listen on loopback, plaintext, and stunnel holds the public listeners:

* **kafka**: TLS with a client certificate required and verified against the cluster's CA (mutual
  TLS, Kafka's ``SSL`` security protocol): a plaintext client, a client without a certificate and one
  with a certificate of another CA fail the handshake.
* **s3**: HTTPS; the S3 server authenticates each request by its role's key (SigV4) and enforces the
  role's actions.

stunnel reads everything from its configuration file (no secret in its arguments) and runs in the
foreground, supervised like the two servers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

STUNNEL_BINARIES = ("stunnel", "stunnel4")


def find_stunnel_bin() -> str:
    for name in STUNNEL_BINARIES:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("stunnel not found on PATH: a secured embedded stack terminates TLS with it "
                            "(Debian/Ubuntu: `apt-get install stunnel4`; `make install` does it as root)")


def stunnel_conf(*, bind_host: str, kafka_port: int, kafka_backend: int, s3_port: int, s3_backend: int,
                 cert_file: Path, key_file: Path, ca_file: Path) -> str:
    """The configuration: two services, each from a public port to a loopback backend."""
    common = f"cert = {cert_file}\nkey = {key_file}\nsslVersionMin = TLSv1.2\n"
    return (
        "foreground = yes\n"
        "pid =\n"
        "syslog = no\n"
        "debug = notice\n"
        "[kafka]\n"
        f"accept = {bind_host}:{kafka_port}\n"
        f"connect = 127.0.0.1:{kafka_backend}\n"
        f"{common}"
        f"CAfile = {ca_file}\n"
        "requireCert = yes\n"
        "verifyChain = yes\n"
        "[s3]\n"
        f"accept = {bind_host}:{s3_port}\n"
        f"connect = 127.0.0.1:{s3_backend}\n"
        f"{common}"
    )
