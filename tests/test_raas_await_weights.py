"""``RaasNode._await_weights``: an episode whose task names a version the node does not serve yet
starts when the follower's refresh thread serves it (the follower's served-version listener sets an
event on the node's loop), and does not poll in between. No broker: the follower is a stand-in."""

from __future__ import annotations

import asyncio
import functools
import threading
import types

import pytest

from astraflow.raas.node import RaasNode


class _Follower:
    def __init__(self) -> None:
        self.checks = 0

    def check(self) -> None:
        self.checks += 1


def _node(engine_version: int) -> tuple[RaasNode, types.SimpleNamespace, _Follower]:
    node = RaasNode.__new__(RaasNode)  # only the waiting side of the node is exercised
    engine = types.SimpleNamespace(weight_version=engine_version)
    node.engines, node.follower = {"pi": engine}, _Follower()
    node.node_id, node.stop_event, node.weights_timeout_s = "node-w", threading.Event(), 30.0
    return node, engine, node.follower


def _task(version: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(policy="pi", emitted_version=version)


def test_an_episode_starts_when_the_refresh_thread_serves_its_version():
    async def scenario() -> tuple[bool, int, int]:
        node, engine, follower = _node(1)
        node._weights_served = asyncio.Event()
        notify = functools.partial(asyncio.get_running_loop().call_soon_threadsafe, node._weights_served.set)
        waiting = asyncio.create_task(node._await_weights(_task(2)))
        await asyncio.sleep(0.5)
        done_before = waiting.done()
        checks_while_waiting = follower.checks

        def refresh() -> None:  # what the follower's refresh thread does when the engine serves v2
            engine.weight_version = 2
            notify()

        threading.Thread(target=refresh).start()
        await asyncio.wait_for(waiting, timeout=5)
        return done_before, checks_while_waiting, follower.checks

    done_before, checks_while_waiting, checks_after = asyncio.run(scenario())
    assert not done_before  # v1 served: the task for v2 waits
    # It sleeps on the event (re-checking every 0.1 s), where the old loop polled every 10 ms (~50).
    assert checks_while_waiting <= 10
    assert checks_after >= checks_while_waiting


def test_a_stop_while_waiting_hands_the_task_back():
    async def scenario() -> None:
        node, _, _ = _node(1)
        node._weights_served = asyncio.Event()
        waiting = asyncio.create_task(node._await_weights(_task(2)))
        await asyncio.sleep(0.15)
        node.stop_event.set()
        await asyncio.wait_for(waiting, timeout=5)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scenario())


def test_a_served_version_does_not_wait():
    async def scenario() -> int:
        node, _, follower = _node(3)
        node._weights_served = asyncio.Event()
        await node._await_weights(_task(2))
        return follower.checks

    assert asyncio.run(scenario()) == 0
