"""The shared name registry behind datasets, workflows, rewards, engines, trainer backends and dataflow plug-ins."""

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


def test_builder_entries_with_a_default_and_a_connector(tmp_path, monkeypatch):
    """The shape of engines and trainer backends: each entry is an options model and a builder, an
    entry without ``type`` is the default plug-in, and a connector module is imported (and registers
    its plug-in) only when a recipe names it."""
    (tmp_path / "registry_test_widgets.py").write_text(
        "from typing import Literal\n"
        "from astraflow.registry import PluginConfig, Registry\n"
        "class Plain(PluginConfig):\n"
        "    type: Literal['plain'] = 'plain'\n"
        "    size: int = 1\n"
        "WIDGETS = Registry('widget', default='plain',\n"
        "                  connectors={'remote': 'registry_test_remote', 'gone': 'registry_test_gone'})\n"
        "@WIDGETS.register_builder('plain', Plain)\n"
        "def build_plain(config, scale):\n"
        "    return config.size * scale\n")
    (tmp_path / "registry_test_remote.py").write_text(
        "from typing import Literal\n"
        "from astraflow.registry import PluginConfig\n"
        "from registry_test_widgets import WIDGETS\n"
        "class Remote(PluginConfig):\n"
        "    type: Literal['remote'] = 'remote'\n"
        "    url: str\n"
        "@WIDGETS.register_builder('remote', Remote)\n"
        "def build_remote(config, scale):\n"
        "    return config.url\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys

    from registry_test_widgets import WIDGETS, Plain

    assert WIDGETS.parse(None) == Plain() and WIDGETS.parse({"size": 3}) == Plain(size=3)
    parsed = WIDGETS.parse("plain")
    assert WIDGETS.parse(parsed) is parsed  # options parsed already are not parsed again
    assert WIDGETS.build({"size": 2}, 10) == 20
    with pytest.raises(ValueError, match="widget 'plain': sise: Extra inputs are not permitted"):
        WIDGETS.parse({"sise": 2})
    with pytest.raises(ValueError, match="Plain.type must default to 'other'"):
        WIDGETS.register_builder("other", Plain)

    assert "remote" not in WIDGETS and "registry_test_remote" not in sys.modules
    assert WIDGETS.build({"type": "remote", "url": "http://h"}, 1) == "http://h"
    assert "remote" in WIDGETS
    with pytest.raises(ValueError, match="widget 'gone': cannot import its connector 'registry_test_gone'"):
        WIDGETS.parse("gone")
    for name in ("registry_test_widgets", "registry_test_remote"):
        monkeypatch.delitem(sys.modules, name)


def test_engines_and_backends_share_the_registry():
    from astraflow.engines import ENGINES, HFEngineConfig, parse_engine
    from astraflow.registry import Builder
    from astraflow.trainer.config import BACKENDS, TorchBackendConfig, parse_backend

    assert isinstance(ENGINES.get("hf"), Builder) and isinstance(BACKENDS.get("torch"), Builder)
    assert parse_engine({"seed": 3}) == HFEngineConfig(seed=3) and parse_backend(None) == TorchBackendConfig()
    with pytest.raises(ValueError, match="trainer backend 'torch': lrr: Extra inputs are not permitted"):
        parse_backend({"lrr": 1e-3})
