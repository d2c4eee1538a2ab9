"""Writers to the bucket wait out a restarting S3 server (issue 9 item 4): ``wait_out_outage`` retries
an idempotent call while the bucket is unreachable, one log line per backoff step, and raises every
other error at once; then a WeightPublisher and a state save (the dataflow's ``put_json``) on an
embedded stack whose S3 server is killed and started again 3 s later complete, with a few lines."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path

import pytest

from astraflow.objstore.errors import ChecksumError, ObjectStoreUnavailableError
from astraflow.outage import OutageReport, wait_out_outage


def _flaky(failures: int, error: BaseException | None = None):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= failures:
            raise error or ObjectStoreUnavailableError("S3 endpoint http://s3:1 unreachable (put k): refused")
        return "done"

    return fn, calls


def test_wait_out_outage_retries_unavailable_and_reports_once_on_recovery(caplog):
    report = OutageReport("test: S3 endpoint", "http://s3:1", logging.getLogger("t.wait"))
    fn, calls = _flaky(3)
    with caplog.at_level(logging.WARNING, logger="t.wait"):
        assert wait_out_outage(fn, report, max_retry_s=0.01) == "done"
    lines = [r.getMessage() for r in caplog.records]
    assert len(calls) == 4 and not report.down
    assert len(lines) == 2 and "unreachable" in lines[0] and "answers again" in lines[1], lines


def test_wait_out_outage_raises_other_errors_at_once_and_gives_up_at_the_deadline(caplog):
    report = OutageReport("test: S3 endpoint", "http://s3:1", logging.getLogger("t.wait"))
    fn, calls = _flaky(5, ChecksumError("k", "aa", "bb"))
    with pytest.raises(ChecksumError):
        wait_out_outage(fn, report, max_retry_s=0.01)
    assert len(calls) == 1

    fn, calls = _flaky(10**6)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="t.wait"), pytest.raises(ObjectStoreUnavailableError):
        wait_out_outage(fn, report, deadline_s=0.3, max_retry_s=0.02)
    assert 0.3 <= time.monotonic() - t0 < 3 and len(calls) > 2
    assert "giving up after 0 s" in caplog.records[-1].getMessage()

    stop = threading.Event()
    stop.set()
    fn, calls = _flaky(10**6)
    with pytest.raises(ObjectStoreUnavailableError):
        wait_out_outage(fn, report, stop=stop)
    assert len(calls) == 1


def test_publisher_and_state_save_wait_out_a_restarting_s3_server(tmp_path: Path, caplog):
    import torch

    from astraflow.config import ClusterConfig
    from astraflow.delta.publisher import WeightPublisher
    from astraflow.delta.store import WeightStore
    from astraflow.embedded import EmbeddedStack
    from astraflow.objstore import ObjectStore

    stack, _ = EmbeddedStack.start_private(tmp_path / "state")
    try:
        cfg = ClusterConfig(run=f"s3wait-{uuid.uuid4().hex[:6]}", state_dir=tmp_path / "state").resolve()
        torch.manual_seed(0)
        state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
        pub = WeightPublisher(cfg, "policy", anchor_every=10, announce=False)
        pub.publish(state, 0)
        pub.flush()

        store = ObjectStore.from_config(cfg)
        s3 = OutageReport("dataflow: state save, S3 endpoint", str(cfg.s3.endpoint), logging.getLogger("t.save"))
        saved: dict = {}

        def save() -> None:
            saved["result"] = wait_out_outage(lambda: store.put_json(f"{cfg.run}/dataflow/state.json", {"n": 1}), s3)

        with caplog.at_level(logging.WARNING):
            stack.s3.kill()
            state = {k: v + 0.01 for k, v in state.items()}
            pub.publish(state, 1)  # queued: the upload waits on the publisher's thread
            pub.publish({k: v + 0.01 for k, v in state.items()}, 2)
            saver = threading.Thread(target=save)
            saver.start()
            time.sleep(3)  # deliberate: a 3 s outage that the publisher and the save must wait out, logging it
            stack.start_service(stack.s3.name)
            t0 = time.monotonic()
            pub.flush()
            saver.join(timeout=60)
            waited = time.monotonic() - t0
            pub.close()
        lines = [r.getMessage() for r in caplog.records if "S3 endpoint" in r.getMessage()]
        print(f"publish and save resumed {waited:.1f} s after the restart; {len(lines)} lines:", *lines, sep="\n")
        assert not saver.is_alive() and "result" in saved
        assert [m.version for m in pub.published] == [0, 1, 2]
        assert sorted(WeightStore.from_config(cfg, "policy").versions()) == [0, 1, 2]
        assert store.get_json(f"{cfg.run}/dataflow/state.json") == {"n": 1}
        pub_lines = [line for line in lines if line.startswith("weight publisher policy")]
        save_lines = [line for line in lines if line.startswith("dataflow: state save")]
        for group in (pub_lines, save_lines):
            assert 2 <= len(group) <= 6, lines
            assert str(cfg.s3.endpoint) in group[0] and "unreachable" in group[0] and "answers again" in group[-1]
        assert not any(r.exc_info for r in caplog.records if r.levelno >= logging.WARNING)
    finally:
        stack.down()
