"""The recipe's ``report`` sinks, fed from a real metrics topic: what each wrote is read back."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
from control_records_factory import node_status, trainer_step
from sink_readers import read_mlflow_scalars, read_scalars, read_wandb_scalars

from astraflow.log import LogProducer, Topics, ensure_topics
from astraflow.records.control import send_control
from astraflow.report.sinks import MLflowSinkConfig, ReportConfig, TensorBoardSinkConfig, WandbSinkConfig
from astraflow.report.sinks.consumer import run_sinks

pytestmark = pytest.mark.integration

TAGS = ("policy/reward_mean", "policy/truncated_frac", "pool/default/tokens_per_s")


def test_every_sink_gets_reward_truncated_fraction_and_tokens_per_s_per_step(test_cluster, tmp_path: Path) -> None:
    metrics = Topics(test_cluster.run).metrics
    ensure_topics(test_cluster, {metrics: 1})  # as a run creates it: one partition, records in order
    with LogProducer(test_cluster, "test-sinks") as producer:
        for step in (1, 2, 3):
            send_control(producer, metrics, "trainer.policy",
                         trainer_step("policy", step, reward_mean=0.1 * step, truncated_frac=0.6 / step,
                                      response_len_mean=30.0, response_len_max=48, clip_frac=0.02, behav_kl=0.001))
            send_control(producer, metrics, f"raas-default-{step % 2}",
                         node_status(f"raas-default-{step % 2}", tokens_per_s=100.0 * step, time=100.5 + step))
        producer.send_json(metrics, "my-evaluator", {"component": "my-evaluator", "accuracy": 0.5})  # not ours
        producer.flush()

    report = ReportConfig(tensorboard=TensorBoardSinkConfig(dir=tmp_path / "tb"),
                          mlflow=MLflowSinkConfig(tracking_uri=f"file:{tmp_path / 'mlruns'}", experiment="tests"),
                          wandb=WandbSinkConfig(project="tests", dir=tmp_path / "wb"))
    stats = run_sinks(test_cluster, report, threading.Event(), idle_exit_s=2.0)
    assert stats.records == 7

    scalars = read_scalars(tmp_path / "tb" / test_cluster.run)

    def series(tag: str) -> tuple[list[int], list[float]]:
        points = scalars[tag]
        return [s for s, _ in points], [v for _, v in points]

    assert series("policy/reward_mean") == ([1, 2, 3], pytest.approx([0.1, 0.2, 0.3]))
    assert series("policy/truncated_frac") == ([1, 2, 3], pytest.approx([0.6, 0.3, 0.2]))
    assert series("policy/response_len_max") == ([1, 2, 3], [48.0] * 3)
    assert series("policy/busy_fraction") == ([1, 2, 3], pytest.approx([1.0 / 1.3] * 3))
    # each node's latest rate summed over the pool, at the latest trainer step
    assert series("pool/default/tokens_per_s") == ([1, 2, 3], pytest.approx([100.0, 300.0, 500.0]))

    # MLflow's local file store and W&B's offline run files (the Record protos `wandb sync` uploads),
    # each read back through the library's own types: the same figures against the trainer step
    logged = {"mlflow": read_mlflow_scalars(f"file:{tmp_path / 'mlruns'}", "tests", test_cluster.run, TAGS),
              "wandb": read_wandb_scalars(tmp_path / "wb" / "wandb", step_key="trainer/step")}
    for sink, tag in itertools.product(logged, TAGS):
        steps, values = zip(*sorted(logged[sink][tag]))
        assert (list(steps), list(values)) == (series(tag)[0], pytest.approx(series(tag)[1])), (sink, tag)


def test_wandb_online_without_an_api_key_is_one_config_error(monkeypatch, tmp_path: Path) -> None:
    """No key anywhere (variable, netrc, W&B's settings): the library's refusal becomes a ConfigError,
    which the CLI prints as one line; nothing is asked on the terminal and nothing reaches the network."""
    from astraflow.config import ConfigError
    from astraflow.report.sinks.wandb import WandbSink

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name, value in {"HOME": tmp_path, "NETRC": tmp_path / "netrc", "WANDB_CONFIG_DIR": tmp_path / "config",
                        "WANDB_MODE": "offline"}.items():
        monkeypatch.setenv(name, str(value))  # restored after: the sink sets WANDB_MODE for the library
    with pytest.raises(ConfigError, match=r"report\.wandb \(online\): .*API key"):
        WandbSink(WandbSinkConfig(project="tests", mode="online", dir=tmp_path / "wb"), "online-run")
