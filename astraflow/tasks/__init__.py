"""Generated datasets (seeded, train/held-out split by prompt), registered by name."""

from astraflow.tasks import arithmetic as _arithmetic  # noqa: F401  (registers the datasets)
from astraflow.tasks.base import DATASETS, Dataset, Problem, build_dataset, register_dataset, split_of
from astraflow.tasks.verify import verifier_prompt

__all__ = ["DATASETS", "Dataset", "Problem", "build_dataset", "register_dataset", "split_of",
           "verifier_prompt"]
