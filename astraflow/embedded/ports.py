"""Loopback port checks and the port plan of the embedded stack.

``weed mini`` opens a dozen listeners; every one of them is named here so that all of them can be
bound to loopback and checked before start (a taken port must fail with a message naming it).
"""

from __future__ import annotations

import random
import socket

from pydantic import BaseModel, ConfigDict, Field

LOOPBACK = "127.0.0.1"

# SeaweedFS's admin worker dials ``admin.port + 10000`` whatever ``-admin.port.grpc`` says, so the
# admin gRPC port is derived, not configurable.
ADMIN_GRPC_OFFSET = 10000


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """True when nothing listens on ``host:port`` and it can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the servers do (Go and Rust set it): connections of a stopped server linger in
        # TIME_WAIT and would otherwise make its port look taken for a minute.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class StackPorts(BaseModel):
    """Every TCP port the embedded stack listens on (all on 127.0.0.1)."""

    model_config = ConfigDict(extra="forbid")

    kafka: int = Field(default=9092, ge=1, le=65535)
    """Kafka protocol listener of the Tansu broker (the bootstrap address clients use)."""
    s3: int = Field(default=8333, ge=1, le=65535)
    """SeaweedFS S3 API (the endpoint clients use)."""
    master: int = Field(default=18331, ge=1, le=65535)
    """SeaweedFS master HTTP."""
    volume: int = Field(default=18332, ge=1, le=65535)
    """SeaweedFS volume server HTTP."""
    filer: int = Field(default=18333, ge=1, le=65535)
    """SeaweedFS filer HTTP."""
    master_grpc: int = Field(default=18334, ge=1, le=65535)
    volume_grpc: int = Field(default=18335, ge=1, le=65535)
    filer_grpc: int = Field(default=18336, ge=1, le=65535)
    s3_grpc: int = Field(default=18337, ge=1, le=65535)
    s3_iceberg: int = Field(default=18338, ge=1, le=65535)
    """SeaweedFS Iceberg REST catalog (unused by AstraFlow, but weed opens it)."""
    s3_lance: int = Field(default=18339, ge=1, le=65535)
    """SeaweedFS Lance namespace (unused by AstraFlow, but weed opens it)."""
    admin: int = Field(default=18340, ge=1, le=65535 - ADMIN_GRPC_OFFSET)
    """SeaweedFS admin HTTP; its gRPC listener is this + 10000."""

    @property
    def admin_grpc(self) -> int:
        return self.admin + ADMIN_GRPC_OFFSET

    def by_service(self) -> dict[str, int]:
        """``{"kafka": 9092, "s3": 8333, ..., "admin_grpc": 28340}``: every port that will be bound."""
        ports = self.model_dump()
        ports["admin_grpc"] = self.admin_grpc
        return ports

    def taken(self, host: str = LOOPBACK) -> dict[str, int]:
        """The ports of this plan that something already listens on."""
        return {name: port for name, port in self.by_service().items() if not port_is_free(port, host)}

    @classmethod
    def plan(cls, kafka: int = 9092, s3: int = 8333, internal_base: int = 18331) -> StackPorts:
        """Kafka and S3 where clients expect them, SeaweedFS's internal listeners on
        ``internal_base`` .. ``internal_base + 9`` (admin gRPC on ``internal_base + 10009``)."""
        internal = [name for name in cls.model_fields if name not in ("kafka", "s3")]
        return cls(kafka=kafka, s3=s3, **{name: internal_base + i for i, name in enumerate(internal)})

    @classmethod
    def free(cls, low: int = 20000, high: int = 32000) -> StackPorts:
        """A plan of currently free random ports below the kernel's ephemeral range (so outgoing
        client connections do not grab them between this check and the bind)."""
        rng = random.SystemRandom()
        chosen: set[int] = set()

        def pick(ok=lambda p: True) -> int:
            for _ in range(1000):
                port = rng.randrange(low, high)
                if port not in chosen and port_is_free(port) and ok(port):
                    chosen.add(port)
                    return port
            raise RuntimeError(f"no free loopback port found in [{low}, {high})")

        names = [name for name in cls.model_fields if name != "admin"]
        plan = {name: pick() for name in names}
        admin = pick(lambda p: p + ADMIN_GRPC_OFFSET not in chosen and port_is_free(p + ADMIN_GRPC_OFFSET))
        chosen.add(admin + ADMIN_GRPC_OFFSET)
        return cls(admin=admin, **plan)
