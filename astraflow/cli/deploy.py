"""``astraflow deploy k8s RECIPE --out DIR`` and ``astraflow deploy topics`` (:mod:`astraflow.deploy.k8s`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from astraflow.cli.cluster_args import load_cluster

RUN_ID_HELP = "run id (default: the cluster config's / $ASTRAFLOW_RUN, else the recipe's `run`)"


def register(subparsers: argparse._SubParsersAction) -> None:
    deploy = subparsers.add_parser(
        "deploy", help="deploy a recipe on a cluster: Kubernetes manifests (KEDA scales the RaaS pools)",
        description="Render what runs a recipe on a cluster with a real Kafka and S3, configured by the "
        "cluster config (--config / ASTRAFLOW_*).")
    targets = deploy.add_subparsers(dest="target", metavar="TARGET", required=True)
    k8s = targets.add_parser(
        "k8s", help="write Kubernetes manifests of a recipe to a folder (kubectl apply -f DIR)",
        description="The dataflow and the archiver as Deployments, one Job per trainer, one Deployment per "
        "RaaS pool with a KEDA ScaledObject on its task topic's consumer-group lag; the cluster config as "
        "a ConfigMap, its credentials as a Secret. See docs/scale.md#kubernetes.")
    k8s.add_argument("recipe", type=Path, help="recipe YAML (validated here; the image must contain it)")
    k8s.add_argument("--out", type=Path, required=True, help="folder of the manifests (a file per component)")
    k8s.add_argument("--image", default="astraflow:local", help="container image (default: %(default)s, "
                     "infra/Dockerfile's tag)")
    k8s.add_argument("--recipe-in-image", metavar="PATH",
                     help="the recipe's path in the image (default: RECIPE, which must then be relative)")
    k8s.add_argument("--namespace", help="namespace of every object (default: kubectl's)")
    k8s.add_argument("--run-id", help=RUN_ID_HELP)
    k8s.add_argument("--no-archive", action="store_true", help="no archiver")
    k8s.add_argument("--trainer-ranks-per-pod", type=int, default=1, metavar="N",
                     help="a multi-rank trainer (trainer.ranks > 1) runs N ranks per pod, one "
                     "torch.distributed.run agent each (default: %(default)s)")
    k8s.add_argument("--prometheus-port", type=int, default=9400, metavar="PORT",
                     help="each component's Prometheus /metrics port, annotated for scraping; 0: none "
                     "(default: %(default)s)")
    k8s.set_defaults(func=cmd_k8s)
    topics = targets.add_parser(
        "topics", help="create a run's topics with the partition counts `astraflow run` gives them "
        "(idempotent)", description="What every pod of a deployment runs first: a pool's task topic gets a "
        "partition per node the pool may have, before any component creates it with fewer.")
    topics.add_argument("--recipe", required=True, help="recipe YAML")
    topics.add_argument("--run-id", help=RUN_ID_HELP)
    topics.set_defaults(func=cmd_topics)


def _recipe_and_cluster(args: argparse.Namespace, recipe_path: Path):
    from astraflow.recipe import Recipe

    recipe = Recipe.load(recipe_path)
    cfg = load_cluster(args)
    # The components' rule (astraflow.cli.components._setup): --run-id, else a configured run, else the
    # recipe's.
    run = args.run_id or (cfg.run if "run" in cfg.model_fields_set else recipe.run)
    return recipe.model_copy(update={"run": run}), cfg.model_copy(update={"run": run})


def cmd_k8s(args: argparse.Namespace) -> int:
    from astraflow.config import ConfigError
    from astraflow.deploy.k8s import K8sOptions, render, write

    in_image = args.recipe_in_image or str(args.recipe)
    if Path(in_image).is_absolute() and not args.recipe_in_image:
        raise ConfigError(f"{args.recipe} is an absolute path: give the recipe's path in the image "
                          "(--recipe-in-image examples/recipes/NAME.yaml)")
    recipe, cfg = _recipe_and_cluster(args, args.recipe)
    opts = K8sOptions(image=args.image, recipe_path=in_image, namespace=args.namespace,
                      archive=not args.no_archive, trainer_ranks_per_pod=args.trainer_ranks_per_pod,
                      prometheus_port=args.prometheus_port)
    for path in write(render(recipe, cfg, opts), args.out):
        print(path)
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    from astraflow.launcher.plan import run_topics
    from astraflow.log import ensure_topics

    recipe, cfg = _recipe_and_cluster(args, Path(args.recipe))
    created = ensure_topics(cfg.resolve(), run_topics(recipe, cfg.run))
    print(json.dumps({"run": cfg.run, "created": created}))
    return 0
