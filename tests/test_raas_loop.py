"""The whole loop on the real stack, in one process: dataflow -> RaaS node -> dataflow -> trainer ->
weight plane -> RaaS node. Small enough to run in CI (tiny model, 3 steps)."""

from __future__ import annotations

import threading
import time

import pytest
from raas_support import TopicReader, load_tiny_model, make_recipe

from astraflow.records.control import NodeStatus, TrainerDone, TrainerStep


@pytest.mark.slow
def test_dataflow_node_and_trainer_close_the_loop(test_cluster):
    import torch
    from dataflow_helpers import run_dataflow

    from astraflow.log import Topics
    from astraflow.raas import run_raas_node
    from astraflow.recipe.data import recipe_tasks
    from astraflow.trainer.service import run_trainer

    torch.set_num_threads(1)
    # transformers resolves its classes lazily, and that is not thread-safe: import them once here
    # (the real components are separate processes)
    load_tiny_model()
    cfg = test_cluster
    recipe = make_recipe(cfg.run, trainer={"steps": 3, "checkpoint_every": 2},
                         dataflow={"groups_per_batch": 2, "max_staleness": 1})
    stop = threading.Event()
    results: dict = {}

    def start(name, fn, *args, **kwargs):
        def body():
            try:
                results[name] = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
                results[name] = exc
        t = threading.Thread(target=body, name=name, daemon=True)
        t.start()
        return t

    trainer = start("trainer", run_trainer, cfg, recipe, "policy", stop)
    dataflow = start("dataflow", run_dataflow, cfg, recipe.dataflow, stop, dataset=recipe_tasks(recipe),
                     pools=["default"], metrics_every_s=1.0, checkpoint_every_s=2.0)
    node = start("node", run_raas_node, cfg, recipe, "default", "loop-node", stop, metrics_every_s=1.0)
    try:
        trainer.join(240)
        assert not trainer.is_alive(), "trainer did not finish 3 steps"
    finally:
        stop.set()
        dataflow.join(60)
        node.join(60)
    assert not isinstance(results.get("trainer"), BaseException), results
    assert results["trainer"]["step"] == 3 and results["trainer"]["finished"]
    for name in ("dataflow", "node"):
        assert not isinstance(results.get(name), BaseException), results
    metrics = TopicReader(cfg, Topics(cfg.run).metrics)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not any(isinstance(r, TrainerDone) for r in metrics.records):
        metrics.read()
    metrics.close()
    steps = [r for r in metrics.records if isinstance(r, TrainerStep)]
    assert [r.step for r in steps] == [1, 2, 3]
    nodes = [r for r in metrics.records if isinstance(r, NodeStatus)]
    assert nodes and max(r.trajectories for r in nodes) >= 8
    assert max(r.versions["policy"] for r in nodes) >= 1  # the node followed the trainer
