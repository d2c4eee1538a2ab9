"""``astraflow raas | trainer | dataflow``: start one component against a cluster config.

Each runs until done (trainer), or until SIGTERM / SIGINT, which set a stop event for a clean stop
(a RaaS node finishes its running episodes, a trainer checkpoints, the dataflow checkpoints).
A second signal exits at once (nothing is lost: every component is safe to kill).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from typing import Any

from astraflow.cli.cluster_args import load_cluster
from astraflow.log.client_logs import summarise_kafka_logs


def register(subparsers: argparse._SubParsersAction) -> None:
    raas = subparsers.add_parser(
        "raas", aliases=["node"],
        help="run a RaaS node of a pool (consume tasks, produce trajectories, follow weights)",
        description="Join the consumer group of <run>.tasks.<pool>, run episodes with one engine per "
        "policy, produce trajectories and refresh weights between generation steps.")
    _common(raas)
    raas.add_argument("--cluster", dest="config", default=argparse.SUPPRESS, metavar="YAML",
                      help="the cluster config or a node credential file (`astraflow credentials issue node`); "
                      "same as the global --config")
    raas.add_argument("--pool", default=None, help="pool name from the recipe (default: its first pool)")
    raas.add_argument("--node-id", default=None, help="node id (default: <host>-<pid>-<random>)")
    raas.set_defaults(func=cmd_raas)

    trainer = subparsers.add_parser(
        "trainer", help="run the trainer of one policy (batches in, weight versions out)",
        description="Consume <run>.batches.<policy>, take GRPO/PPO steps, publish weights, checkpoint "
        "to the bucket and resume from it.")
    _common(trainer)
    trainer.add_argument("--policy", default=None, help="policy name (default: the recipe's first policy)")
    trainer.set_defaults(func=cmd_trainer)

    dataflow = subparsers.add_parser(
        "dataflow", help="run the dataflow (task emitter, trajectory processing, batch assembly)",
        description="Emit tasks from the recipe's dataset, turn trajectories into training batches, "
        "publish counters and the autoscaling report.")
    _common(dataflow)
    dataflow.add_argument("--until-finished", action="store_true",
                          help="exit when the dataset is used up and nothing is in flight")
    dataflow.add_argument("--no-archive", dest="archived", action="store_false",
                          help="the run has no archiver: trim the log without waiting for the archive group")
    dataflow.set_defaults(func=cmd_dataflow)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="recipe YAML")
    p.add_argument("--run-id", default=None,
                   help="run id (default: the cluster config's / $ASTRAFLOW_RUN, else the recipe's `run`)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; $ASTRAFLOW_TORCH_THREADS)")
    p.add_argument("--log-level", default=os.environ.get("ASTRAFLOW_LOG_LEVEL", "INFO"))


def log_to_stderr(level: str) -> None:
    """A component's log: timestamped lines on stderr at ``level``, kafka-python's chatter at WARNING."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per request (vllm-server engine, http env)


def _setup(args: argparse.Namespace) -> tuple[Any, Any, threading.Event]:
    """Cluster config (resolved, with the run id), recipe and a stop event wired to SIGTERM/SIGINT."""
    from astraflow.recipe import Recipe

    log_to_stderr(args.log_level)
    recipe = Recipe.load(args.recipe)
    cfg = load_cluster(args)
    # --run-id, else a run set in the cluster config / $ASTRAFLOW_RUN (the launcher's way), else the recipe's
    run = args.run_id or (cfg.run if "run" in cfg.model_fields_set else recipe.run)
    recipe = recipe.model_copy(update={"run": run})
    cfg = cfg.model_copy(update={"run": run}).resolve()
    summarise_kafka_logs(cfg.kafka.bootstrap or "?")  # a lost broker: a line per backoff step, not 25/s
    threads = args.threads or int(os.environ.get("ASTRAFLOW_TORCH_THREADS", "0") or 0)
    if threads:
        import torch

        torch.set_num_threads(threads)
    if int(os.environ.get("RANK", "0")) == 0:  # one endpoint per component: a trainer group's rank 0
        from astraflow.prometheus import serve_prometheus

        serve_prometheus(cfg.prometheus, args.command)
    return cfg, recipe, _stop_on_signals()


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            os._exit(128 + signum)  # second signal: leave now (uncommitted work is re-delivered)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def cmd_raas(args: argparse.Namespace) -> int:
    from astraflow.raas import run_raas_node

    cfg, recipe, stop = _setup(args)
    pool = args.pool or recipe.pools[0].name
    node_id = args.node_id or f"{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    counters = run_raas_node(cfg, recipe, pool, node_id, stop, drain_timeout_s=recipe.pool(pool).drain_timeout_s)
    print(json.dumps({"node_id": node_id, "episodes": counters.episodes, "trajectories": counters.trajectories,
                      "rejected": counters.rejected}))
    return 0


def cmd_trainer(args: argparse.Namespace) -> int:
    from astraflow.trainer.service import run_trainer

    cfg, recipe, stop = _setup(args)
    policy = args.policy or recipe.policies[0].name
    result = run_trainer(cfg, recipe, policy, stop)
    print(json.dumps(result))
    return 0


def cmd_dataflow(args: argparse.Namespace) -> int:
    from astraflow.dataflow.service import DataflowService
    from astraflow.embedded.vacuum import VolumeVacuum
    from astraflow.recipe.data import recipe_tasks

    cfg, recipe, stop = _setup(args)
    service = DataflowService(cfg, recipe.dataflow, recipe_tasks(recipe), pools=[p.name for p in recipe.pools],
                              train_steps=recipe.trainer.steps, archived=args.archived)
    # The run's storage upkeep goes with the log's trimming: the embedded S3 server frees a deleted
    # object's disk (trimmed log batches, collected weights, old checkpoints) only when asked to compact.
    vacuum = VolumeVacuum(cfg.s3.embedded_master, filer_url=cfg.s3.embedded_filer).start() if cfg.s3.embedded_master else None
    try:
        counters = service.run(stop, stop_when_finished=args.until_finished)
    finally:
        if vacuum is not None:
            vacuum.stop()
    retention = service.retention.stats.as_dict() if service.retention is not None else None
    print(json.dumps({**counters, **({"log_retention": retention} if retention else {})}))
    return 0
