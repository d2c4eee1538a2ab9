"""Datasets (generated and from files), registered by name, with seeded train/held-out splits."""

from astraflow.tasks import arithmetic as _arithmetic  # noqa: F401  (registers the datasets)
from astraflow.tasks import files as _files  # noqa: F401
from astraflow.tasks import gsm as _gsm  # noqa: F401
from astraflow.tasks import word_calc as _word_calc  # noqa: F401  (registers word_calc)
from astraflow.tasks.base import (
    DATASETS,
    Dataset,
    DatasetConfig,
    DatasetField,
    GeneratedDataset,
    ListedDataset,
    Problem,
    build_dataset,
    compact,
    register_dataset,
    split_of,
)
from astraflow.tasks.verify import verifier_prompt, wrong_answer

__all__ = ["DATASETS", "Dataset", "DatasetConfig", "DatasetField", "GeneratedDataset", "ListedDataset", "Problem",
           "build_dataset", "compact", "register_dataset", "split_of", "verifier_prompt", "wrong_answer"]
