"""A simulated wide-area link between two regions on one machine: delaying, pacing TCP relays.

The kernel here has no ``netem`` and shaping ``lo`` with ``tc`` would slow every process on the
machine (other people's tests), so the link is simulated in the application: each endpoint of
region A that region B talks to gets a relay, and every relay sends through one shared :class:`Link`
with a one-way ``delay_s`` per direction and a bandwidth cap (bytes are serialised onto the link
at ``rate`` and arrive ``delay_s`` after their last byte was sent, like a real link's
transmission + propagation delay). Bytes are counted per relay and direction.

Region B's processes are pointed at the relays by ``_wan_site/sitecustomize.py``: with
``ASTRAFLOW_BENCH_REDIRECT=host:port=host:relay,...`` in their environment every TCP connect to a
region-A address goes to its relay instead. That catches the addresses a client learns at run time
too (a Kafka broker's advertised listener), which rewriting a config could not.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "_wan_site"
"""Put on region B's ``PYTHONPATH`` (with ``ASTRAFLOW_BENCH_REDIRECT``) to route it through the relays."""
_CHUNK = 64 * 1024
_QUEUE_CHUNKS = 64  # per connection and direction: backpressure instead of unbounded buffering


class _Direction:
    """One direction of the link: transmissions are serialised at ``rate`` bytes/s."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0

    def transmit(self, n: int, now: float) -> float:
        """When the last of ``n`` bytes handed over ``now`` has left (queued behind earlier ones)."""
        start = max(now, self.free_at)
        self.free_at = start + n / self.rate
        return self.free_at


class WanLink:
    """Relays from region B to region A endpoints, all sharing one delayed, capped link (a thread
    running an asyncio loop). ``delay_s`` one way (RTT = 2x), ``mbit_s`` per direction."""

    def __init__(self, delay_s: float = 0.150, mbit_s: float = 20.0) -> None:
        self.delay_s = delay_s
        self.rate = mbit_s * 1e6 / 8
        self.up, self.down = _Direction(self.rate), _Direction(self.rate)  # B -> A, A -> B
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: {"b_to_a": 0, "a_to_b": 0})
        self.connections: dict[str, int] = defaultdict(int)
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="wan-link", daemon=True)
        self._thread.start()

    def relay(self, name: str, host: str, port: int) -> int:
        """A relay (loopback, free port) to ``host:port`` under ``name``; returns its port."""
        async def start() -> int:
            server = await asyncio.start_server(lambda r, w: self._accept(name, host, port, r, w), "127.0.0.1", 0)
            self._servers.append(server)
            return server.sockets[0].getsockname()[1]
        return asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)

    def counters(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.bytes.items()}

    def total(self) -> int:
        return sum(v["b_to_a"] + v["a_to_b"] for v in self.bytes.values())

    def close(self) -> None:
        async def stop() -> None:
            for s in self._servers:
                s.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- one connection --------------------------------------------------------------------------------
    async def _accept(self, name: str, host: str, port: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            await self._connect(name, host, port, reader, writer)
        except asyncio.CancelledError:  # the link is closing
            writer.close()

    async def _connect(self, name: str, host: str, port: int, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        self.connections[name] += 1
        try:
            # Opening the connection costs a round trip, as a TCP handshake over the link would.
            await asyncio.sleep(2 * self.delay_s)
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        for w in (writer, up_writer):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(self._pipe(name, "b_to_a", self.up, reader, up_writer),
                             self._pipe(name, "a_to_b", self.down, up_reader, writer),
                             return_exceptions=True)
        for w in (writer, up_writer):
            w.close()

    async def _pipe(self, name: str, key: str, direction: _Direction, src: asyncio.StreamReader,
                    dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue(_QUEUE_CHUNKS)

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                arrive, data = item
                await asyncio.sleep(max(0.0, arrive - time.monotonic()))
                dst.write(data)
                await dst.drain()
            with contextlib.suppress(OSError):
                if dst.can_write_eof():
                    dst.write_eof()  # half-close: the reply may still come the other way

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await src.read(_CHUNK):
                self.bytes[name][key] += len(data)
                arrive = direction.transmit(len(data), time.monotonic()) + self.delay_s
                await queue.put((arrive, data))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put(None)
            with contextlib.suppress(Exception):
                await sender
