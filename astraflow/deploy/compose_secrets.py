"""The secrets of the secured compose stack (``infra/docker-compose.secure.yml``), generated on the host into
one folder that the compose file mounts into the containers, a file at a time:

```
secure/                    the CA, the server certificate, each role's client certificate and S3 keys,
                           the S3 identities (:class:`astraflow.security.material.SecureMaterial`)
compose/stunnel.conf       the ``tls`` service's listeners, by the paths the compose file mounts them at
compose/<role>.yaml        a role's one-file credential for a container: endpoints on the compose network
                           (``tls:9093``, ``https://tls:8443``), the CA, its certificate, key and S3 keys
compose/tansu.env          the broker's S3 key for its log (``env_file``, read by Compose on the host)
host/<role>.yaml           the same credential for clients on the host, through the published ports
```

Every file is 0600. The containers run as ``CONTAINER_UID`` (infra/Dockerfile's user), so the files they
read are given to that uid (which takes root); the host's files stay the caller's.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from astraflow.config import EMBEDDED_FETCH_MAX_WAIT_MS, ConfigError
from astraflow.embedded.stunnel import Tunnel, stunnel_conf
from astraflow.log.trim import TANSU_BUCKET
from astraflow.security.material import SecureMaterial, write_private
from astraflow.security.roles import ROLES

CONTAINER_UID = 10001
"""infra/Dockerfile's ``astraflow`` user, which every service of the compose file runs as."""
TLS_HOST = "tls"
"""The compose service of the TLS terminator: the name the components reach the log and the bucket by."""
KAFKA_TLS_PORT, KAFKA_HOST_TLS_PORT, S3_TLS_PORT = 9093, 9094, 8443
"""The ``tls`` service's listeners: the log for containers, the log for the host (through a Tansu
proxy that advertises ``localhost``), the bucket for both."""
MOUNT = "/secure"
"""Where the ``tls`` and ``seaweedfs`` services find their files in the container."""


def compose_tunnels() -> list[Tunnel]:
    """``tls``'s listeners, to the servers on the compose stack's back network."""
    return [Tunnel("kafka", f"0.0.0.0:{KAFKA_TLS_PORT}", "tansu:9092", client_cert=True),
            Tunnel("kafka-host", f"0.0.0.0:{KAFKA_HOST_TLS_PORT}", "kafka-host:9092", client_cert=True),
            Tunnel("s3", f"0.0.0.0:{S3_TLS_PORT}", "seaweedfs:8333", client_cert=False)]


def write_compose_secrets(folder: Path, *, hosts: list[str], kafka_port: int, s3_port: int, bucket: str,
                          uid: int = CONTAINER_UID) -> list[Path]:
    """Generate (or keep) the stack's secrets under ``folder`` and write the files of the module doc;
    ``hosts``: more names the server certificate is valid for (a machine's public name). Returns the
    files the containers read, given to ``uid``."""
    if uid != os.geteuid() and os.geteuid() != 0:
        raise ConfigError(f"the compose stack's containers run as uid {uid} and must read their files: run "
                          f"this as root, or pass --uid {os.geteuid()} and run the containers as that user")
    folder = folder.absolute()
    material = SecureMaterial(folder)
    material.ensure([TLS_HOST, "localhost", "127.0.0.1", *hosts], bucket, TANSU_BUCKET)
    compose = folder / "compose"
    fetch_wait = EMBEDDED_FETCH_MAX_WAIT_MS["s3"]  # Tansu's log is in the bucket (s3://tansu/)
    read_in_containers = [material.identities_file, material.server_cert_file, material.server_key_file,
                          material.ca_file]
    read_in_containers.append(write_private(compose / "stunnel.conf", stunnel_conf(
        compose_tunnels(), cert_file=f"{MOUNT}/server.pem", key_file=f"{MOUNT}/server.key",
        ca_file=f"{MOUNT}/ca.pem", resolve_late=True,
        log_level="warning")))  # not a line per health check: refusals only
    for role in ROLES:
        inside = material.credential_file(role, f"{TLS_HOST}:{KAFKA_TLS_PORT}", f"https://{TLS_HOST}:{S3_TLS_PORT}",
                                          bucket, fetch_wait)
        read_in_containers.append(write_private(compose / f"{role}.yaml", yaml.safe_dump(inside, sort_keys=False)))
        outside = material.credential_file(role, f"localhost:{kafka_port}", f"https://localhost:{s3_port}",
                                           bucket, fetch_wait)
        write_private(folder / "host" / f"{role}.yaml", yaml.safe_dump(outside, sort_keys=False))
    admin = material.s3_keys()["admin"]
    write_private(compose / "tansu.env",
                  f"AWS_ACCESS_KEY_ID={admin['access_key']}\nAWS_SECRET_ACCESS_KEY={admin['secret_key']}\n")
    for path in read_in_containers:
        os.chown(path, uid, uid)
    return read_in_containers
