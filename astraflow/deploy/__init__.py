"""Cluster deployments of a recipe: Kubernetes manifests (:mod:`astraflow.deploy.k8s`)."""
