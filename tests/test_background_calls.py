"""BackgroundCalls: calls run in order on one daemon thread; results and errors reach the futures."""

import threading

import pytest

from astraflow.background_calls import BackgroundCalls


def test_calls_run_in_order_on_one_daemon_thread_and_errors_reach_their_future():
    calls = BackgroundCalls("test-calls")
    seen: list[tuple[int, str, bool]] = []
    release = threading.Event()

    def record(i: int) -> int:
        if i == 0:
            release.wait(5)  # the later calls queue behind this one
        t = threading.current_thread()
        seen.append((i, t.name, t.daemon))
        return i * 10

    futures = [calls.submit(lambda i=i: record(i)) for i in range(5)]
    failing = calls.submit(lambda: 1 / 0)
    assert not futures[4].done()
    release.set()
    assert [f.result(5) for f in futures] == [0, 10, 20, 30, 40]
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    assert [i for i, _, _ in seen] == [0, 1, 2, 3, 4]
    assert {(name, daemon) for _, name, daemon in seen} == {("test-calls", True)}
    assert threading.current_thread().name != "test-calls"


def test_close_ends_the_thread_after_the_calls_submitted_and_a_later_call_starts_another():
    calls = BackgroundCalls("test-close")
    first = calls.submit(threading.current_thread)
    calls.close()
    thread = first.result(5)
    thread.join(5)
    assert not thread.is_alive()
    second = calls.submit(threading.current_thread).result(5)
    assert second is not thread and second.name == "test-close"
    calls.close()
