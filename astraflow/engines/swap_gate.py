"""One decoding step or one weight swap at a time, with a waiting swap going first.

Engines decode step by step and take weight swaps from another thread (the node's weight follower).
A plain lock would let the decoding threads take it back step after step, so a swap could wait
several steps (or forever) and tokens would be tagged with a version later than they should be.
With the gate, a swap that started waiting during a step lands right after that step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SwapGate:
    """Mutual exclusion between decoding steps and weight swaps, swaps first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting_swaps = 0
        self._count_lock = threading.Lock()
        self._no_swap = threading.Event()
        self._no_swap.set()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Holds the engine for one step (or any other work on its batch), after any waiting swap."""
        self._no_swap.wait()
        with self._lock:
            yield

    @contextmanager
    def swap(self) -> Iterator[None]:
        """Holds the engine for a weight swap: between two steps, before the next one."""
        with self._count_lock:
            self._waiting_swaps += 1
            self._no_swap.clear()
        try:
            with self._lock:
                yield
        finally:
            with self._count_lock:
                self._waiting_swaps -= 1
                if not self._waiting_swaps:
                    self._no_swap.set()
