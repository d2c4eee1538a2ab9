"""A regional replica of the embedded bucket: a second SeaweedFS fed by ``weed filer.sync``.

Replication is SeaweedFS's own: ``weed filer.sync -isActivePassive`` follows the origin filer's
metadata log and copies every change under ``/buckets/<bucket>`` (content and user metadata, so the
sha256 every AstraFlow read checks travels with the bytes) to the replica's filer, whose S3 gateway
then serves them. It is resumable: its position is kept in the replica filer, so stopping it pauses
replication and starting it again resumes where it stopped (tests use that to hold an announcement
ahead of its objects). Nodes read the replica through ``region`` in their cluster config
(:mod:`astraflow.objstore.regional`); in production the same role is played by S3 bucket
replication or a mirror tool (docs/scale.md#regions).

``SeaweedServer`` is one standalone ``weed mini`` on free loopback ports (the replica, or an origin
of a test's own), with its Prometheus counters (``SeaweedFS_s3_bucket_traffic_sent_bytes_total``:
the bytes its S3 gateway served) on a port of its own.
"""

from __future__ import annotations

from pathlib import Path

from astraflow.embedded.ports import LOOPBACK, StackPorts, port_is_free
from astraflow.embedded.seaweedfs import find_weed_bin, s3_answers, weed_argv, weed_env
from astraflow.embedded.supervisor import SupervisedProcess


def filer_address(host: str, http_port: int, grpc_port: int) -> str:
    """A filer as ``weed`` tools name it: ``host:httpPort.grpcPort`` (the gRPC port is not derived)."""
    return f"{host}:{http_port}.{grpc_port}"


class SeaweedServer:
    """A standalone SeaweedFS (``weed mini``: master, volume, filer, S3) under ``state_dir``."""

    def __init__(self, state_dir: str | Path, access_key: str, secret_key: str, *,
                 buckets: tuple[str, ...] = ("astraflow",), name: str = "seaweedfs",
                 die_with_parent: bool = True, start_timeout_s: float = 60.0) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.access_key, self.secret_key = access_key, secret_key
        self.buckets = list(buckets)
        self.die_with_parent = die_with_parent
        self.start_timeout_s = start_timeout_s
        self.process = SupervisedProcess(name, self.state_dir)
        self.ports: StackPorts | None = None
        self.metrics_port: int | None = None

    @property
    def endpoint(self) -> str:
        """The S3 endpoint (``http://127.0.0.1:<port>``)."""
        return f"http://{LOOPBACK}:{self._ports().s3}"

    @property
    def filer(self) -> str:
        """The filer address ``weed filer.sync`` takes (``127.0.0.1:<http>.<grpc>``)."""
        ports = self._ports()
        return filer_address(LOOPBACK, ports.filer, ports.filer_grpc)

    def _ports(self) -> StackPorts:
        if self.ports is None:
            raise RuntimeError(f"SeaweedFS {self.process.name} under {self.state_dir} is not started")
        return self.ports

    def start(self, attempts: int = 3) -> None:
        """Start on free random loopback ports and wait until S3 answers with the buckets created.
        A port may be taken between the check and the bind (a teammate's test): retried on a new plan."""
        from astraflow.embedded.supervisor import ProcessStartError

        data_dir = self.state_dir / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(attempts):
            self.ports = StackPorts.free()
            self.metrics_port = _free_port(set(self.ports.by_service().values()))
            argv = [*weed_argv(data_dir, self.ports, self.buckets), f"-metricsPort={self.metrics_port}"]
            self.process.spawn(argv, weed_env((self.access_key, self.secret_key)), cwd=self.state_dir,
                               die_with_parent=self.die_with_parent)
            try:
                self.process.wait_until(
                    lambda: s3_answers(self.endpoint, self.access_key, self.secret_key, self.buckets),
                    self.start_timeout_s, f"S3 on {self.endpoint}")
                return
            except ProcessStartError:
                self.process.stop()
                if attempt == attempts - 1:
                    raise

    def stop(self) -> None:
        self.process.stop()


class FilerSync:
    """``weed filer.sync -isActivePassive``: origin filer ``source`` -> replica filer ``target``,
    one bucket directory. :meth:`start` resumes from the position the replica filer keeps;
    :meth:`stop` pauses replication."""

    def __init__(self, state_dir: str | Path, source: str, target: str, *, bucket: str = "astraflow",
                 target_bucket: str | None = None, prefix: str = "", exclude: tuple[str, ...] = (),
                 source_proxy: bool = False, name: str = "filer-sync", die_with_parent: bool = True) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.source, self.target = source, target
        self.bucket, self.target_bucket = bucket, target_bucket or bucket
        self.prefix = prefix.strip("/")
        """Replicate only this directory of the bucket (``<run>``: one run); empty: the whole bucket."""
        self.exclude = exclude
        """Directories under ``prefix`` not to replicate (``trainer``: state no replica reader needs)."""
        self.source_proxy = source_proxy
        """Read the origin's chunks through its filer instead of its volume servers: then only the
        filer's two ports need to be reachable from the replica's side (a relay, a firewall)."""
        self.die_with_parent = die_with_parent
        self.process = SupervisedProcess(name, self.state_dir)

    def argv(self) -> list[str]:
        sub = f"/{self.prefix}" if self.prefix else ""
        src_dir, dst_dir = f"/buckets/{self.bucket}{sub}", f"/buckets/{self.target_bucket}{sub}"
        argv = [find_weed_bin(), "filer.sync", f"-a={self.source}", f"-b={self.target}", "-isActivePassive",
                f"-a.path={src_dir}", f"-b.path={dst_dir}"]
        if self.exclude:
            argv.append("-a.excludePaths=" + ",".join(f"{src_dir}/{p.strip('/')}" for p in self.exclude))
        if self.source_proxy:
            argv.append("-a.filerProxy")
        return argv

    def start(self) -> int:
        """Start (or resume) replication; returns the pid."""
        if self.process.alive():
            return self.process.pid() or 0
        self.state_dir.mkdir(parents=True, exist_ok=True)
        return self.process.spawn(self.argv(), cwd=self.state_dir, die_with_parent=self.die_with_parent)

    def stop(self) -> None:
        """Pause replication (SIGTERM: filer.sync saves its position in the replica filer)."""
        self.process.stop()

    @property
    def running(self) -> bool:
        return self.process.alive()


def _free_port(avoid: set[int], low: int = 20000, high: int = 32000) -> int:
    import random

    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port not in avoid and port_is_free(port):
            return port
    raise RuntimeError(f"no free loopback port found in [{low}, {high})")
