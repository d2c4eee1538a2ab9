"""Reading what a finished run left behind, shared by the end-to-end tests of the connectors."""

from __future__ import annotations

import time
import uuid


def read_trajectories(cfg, timeout_s: float = 60.0) -> list:
    """Every trajectory of the run's topic, read from its start to its end with a throwaway group."""
    from astraflow.log import LogConsumer, Topics
    from astraflow.records import trajectory

    consumer = LogConsumer(cfg, Topics(cfg.run).trajectories, f"test-reader-{uuid.uuid4().hex[:8]}")
    out: list = []
    deadline = time.monotonic() + timeout_s
    quiet_since = time.monotonic()
    try:
        while True:
            msgs = consumer.poll(timeout_s=0.3, max_records=500)
            for m in msgs:
                out.extend(trajectory.from_table(m.table))
            if msgs:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > 1.0 and consumer.caught_up():
                return out
            assert time.monotonic() < deadline, f"trajectories topic not read to its end in {timeout_s} s"
    finally:
        consumer.close()


def teacher_forced(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    """log-probs of ``response`` after ``prompt`` under ``model``'s tempered full softmax."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()
