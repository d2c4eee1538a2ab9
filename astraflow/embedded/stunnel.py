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
from dataclasses import dataclass
from pathlib import Path

STUNNEL_BINARIES = ("stunnel", "stunnel4")


def find_stunnel_bin() -> str:
    for name in STUNNEL_BINARIES:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("stunnel not found on PATH: a secured embedded stack terminates TLS with it "
                            "(Debian/Ubuntu: `apt-get install stunnel4`; `make install` does it as root)")


@dataclass(frozen=True)
class Tunnel:
    """One public TLS listener and the plaintext server behind it."""

    name: str
    accept: str
    """``host:port`` the TLS listener binds."""
    connect: str
    """``host:port`` of the plaintext server behind it (a loopback port, or a compose service's name)."""
    client_cert: bool
    """Mutual TLS: only a client with a certificate of the cluster's CA gets through (the log). Without
    it, TLS only (the bucket, whose requests carry each role's SigV4 key)."""


def stack_tunnels(*, bind_host: str, kafka_port: int, kafka_backend: int, s3_port: int,
                  s3_backend: int) -> list[Tunnel]:
    """The embedded stack's two: a public port each, to a loopback backend."""
    return [Tunnel("kafka", f"{bind_host}:{kafka_port}", f"127.0.0.1:{kafka_backend}", client_cert=True),
            Tunnel("s3", f"{bind_host}:{s3_port}", f"127.0.0.1:{s3_backend}", client_cert=False)]


def stunnel_conf(tunnels: list[Tunnel], *, cert_file: Path | str, key_file: Path | str, ca_file: Path | str,
                 resolve_late: bool = False, log_level: str = "notice") -> str:
    """The configuration of ``tunnels``, all with the server certificate ``cert_file``.
    ``resolve_late``: look a backend's name up at each connection (``delay``), not once at start: a
    compose service that restarts comes back with another address. ``log_level``: stunnel's ``debug``
    (``notice`` logs every connection; ``warning`` only failures, refused handshakes among them)."""
    common = f"cert = {cert_file}\nkey = {key_file}\nsslVersionMin = TLSv1.2\n"
    if resolve_late:
        common += "delay = yes\n"
    sections = []
    for tunnel in tunnels:
        section = f"[{tunnel.name}]\naccept = {tunnel.accept}\nconnect = {tunnel.connect}\n{common}"
        if tunnel.client_cert:
            section += f"CAfile = {ca_file}\nrequireCert = yes\nverifyChain = yes\n"
        sections.append(section)
    return f"foreground = yes\npid =\nsyslog = no\ndebug = {log_level}\n" + "".join(sections)
