"""The shared name registry behind datasets, workflows, rewards and dataflow plug-ins."""

import pytest

from astraflow.registry import Registry
from astraflow.tasks import build_dataset, register_dataset
from astraflow.tasks.base import Dataset


def test_registry_refuses_a_second_object_under_a_taken_name():
    reg: Registry = Registry("thing")
    reg.register("a")(len)
    reg.register("a")(len)  # the same object again (a re-import) is fine
    with pytest.raises(ValueError, match="thing 'a' is already registered by len"):
        reg.register("a")(max)
    assert reg.get("a") is len and "a" in reg and list(reg) == ["a"]
    with pytest.raises(ValueError, match=r"unknown thing 'b'; registered: \['a'\]"):
        reg.get("b")


def test_parse_gives_the_named_plugins_typed_options_and_readable_errors():
    from astraflow.tasks import DATASETS

    cfg = DATASETS.parse({"type": "add", "digits": 3})
    assert type(cfg).__qualname__ == "Addition.Config" and cfg.digits == 3
    assert DATASETS.parse("add").digits == 2  # a bare name is the plug-in with its defaults
    with pytest.raises(ValueError, match="dataset 'add': digits: Input should be a valid integer"):
        DATASETS.parse({"type": "add", "digits": "three"})
    with pytest.raises(ValueError, match="unknown dataset 'sub'"):
        DATASETS.parse({"type": "sub"})
    with pytest.raises(ValueError, match="needs a 'type'"):
        DATASETS.parse({"digits": 3})


def test_datasets_refuse_duplicate_names():
    with pytest.raises(ValueError, match="dataset 'add' is already registered"):
        @register_dataset("add")
        class Shadow(Dataset):
            pass
    assert type(build_dataset("add")).__name__ != "Shadow"
