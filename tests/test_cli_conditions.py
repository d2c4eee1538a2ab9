"""The CLI on what commonly stands in a user's way (issue 39): a stack that is down, an unknown run or
policy, an empty bucket, a recipe path that is wrong. Each answer is one line on stderr and a non-zero
exit status, never a traceback; the commands run as a user runs them (a subprocess of the CLI)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from io import StringIO
from pathlib import Path

import pytest
import yaml

from astraflow.launcher.cluster import write_cluster_file

ROOT = Path(__file__).parent.parent
POLICY = "policy"


def astraflow(args: list[str], env_extra: dict[str, str], cwd: Path, timeout_s: float = 90) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "astraflow.cli.main", *args], env=env, cwd=cwd, text=True,
                          capture_output=True, timeout=timeout_s, check=False)


def one_line_failure(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The failure's stderr, asserted to be one line naming ``fragments``, with a non-zero status."""
    err = proc.stderr.strip()
    assert proc.returncode != 0, (proc.returncode, proc.stdout, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def config_env(test_cluster, tmp_path: Path) -> dict[str, str]:
    return {"ASTRAFLOW_CONFIG": str(write_cluster_file(test_cluster, tmp_path / "cluster.yaml"))}


def test_no_stack_and_no_data_says_what_to_start(tmp_path: Path) -> None:
    env = {"ASTRAFLOW_STATE_DIR": str(tmp_path / "state")}
    for args in (["weights", "ls", "--run", "r", "--policy", POLICY], ["runs", "ls"],
                 ["replay", "r", "--recipe", str(ROOT / "examples/recipes/math.yaml")]):
        one_line_failure(astraflow(args, env, tmp_path), "no embedded stack runs under", "astraflow up")
    assert not (tmp_path / "state" / "stack.json").exists()


@pytest.mark.integration
def test_unreachable_endpoints_give_one_line(tmp_path: Path) -> None:
    env = {"ASTRAFLOW_S3_ENDPOINT": f"http://127.0.0.1:{_free_port()}", "ASTRAFLOW_S3_ACCESS_KEY": "a",
           "ASTRAFLOW_S3_SECRET_KEY": "b", "ASTRAFLOW_KAFKA_BOOTSTRAP": f"127.0.0.1:{_free_port()}"}
    one_line_failure(astraflow(["weights", "ls", "--run", "r", "--policy", POLICY], env, tmp_path),
                     "astraflow weights:", "unreachable")


@pytest.mark.integration
def test_unknown_run_and_bad_recipe_path(config_env, tmp_path: Path) -> None:
    for args in (["weights", "show", "--run", "nope-" + uuid.uuid4().hex[:6], "--policy", POLICY],
                 ["runs", "show", "nope-" + uuid.uuid4().hex[:6]]):
        one_line_failure(astraflow(args, config_env, tmp_path), "no run 'nope-")
    missing = str(tmp_path / "missing.yaml")
    one_line_failure(astraflow(["run", missing], config_env, tmp_path), "recipe not found")


@pytest.mark.integration
def test_empty_bucket(test_cluster, tmp_path: Path) -> None:
    from astraflow.objstore import ObjectStore

    bucket = "empty-" + uuid.uuid4().hex[:10]
    ObjectStore.from_config(test_cluster).client.create_bucket(Bucket=bucket)
    cfg = test_cluster.model_copy(update={"s3": test_cluster.s3.model_copy(update={"bucket": bucket})})
    env = {"ASTRAFLOW_CONFIG": str(write_cluster_file(cfg, tmp_path / "cluster.yaml"))}
    one_line_failure(astraflow(["runs", "ls"], env, tmp_path), f"s3://{bucket}/ holds no run yet")
    one_line_failure(astraflow(["weights", "ls", "--run", "r", "--policy", POLICY], env, tmp_path),
                     f"s3://{bucket}/ holds no run yet")


@pytest.mark.integration
def test_unknown_policy_then_a_quiet_export(test_cluster, config_env, tiny_checkpoint, tmp_path: Path) -> None:
    """A published run: an unknown policy is one line naming the run's policies; an export to a pipe
    draws no progress bar."""
    from astraflow.delta import WeightPublisher
    from astraflow.models import load_model
    from astraflow.trainer.service import publishable

    with WeightPublisher(test_cluster, POLICY, announce=False) as pub:
        pub.publish(publishable(load_model(tiny_checkpoint).state_dict(), "bfloat16"), 0)
        pub.flush()
    run = test_cluster.run
    one_line_failure(astraflow(["weights", "ls", "--run", run, "--policy", "nope"], config_env, tmp_path),
                     "has no weights of policy 'nope'", f"its policies: {POLICY}")

    recipe = yaml.safe_load((ROOT / "examples/recipes/math.yaml").read_text())
    recipe["policies"][0]["model"] = str(tiny_checkpoint)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    proc = astraflow(["weights", "export", "--run", run, "--policy", POLICY, "--recipe", str(tmp_path / "recipe.yaml"),
                      str(tmp_path / "out")], config_env, tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert f"{run} / {POLICY} v0 ->" in proc.stdout and (tmp_path / "out" / "config.json").exists()


@pytest.mark.integration
def test_a_stopped_stack_with_data_is_started_for_the_command_and_stopped(tmp_path: Path) -> None:
    """What `astraflow run` leaves: a state dir whose stack is stopped, its bucket holding the run. A
    bucket command starts the stack there (as `run` does), answers, and stops it again."""
    from astraflow.config import ClusterConfig
    from astraflow.embedded import EmbeddedStack
    from astraflow.objstore import ObjectStore

    state = tmp_path / "state"
    stack, _ = EmbeddedStack.start_private(state, storage="memory")
    try:
        ObjectStore.from_config(ClusterConfig(state_dir=state).resolve()).put_json("kept-run/dataflow/x.json", {})
    finally:
        stack.down()
    proc = astraflow(["runs", "ls", "--json"], {"ASTRAFLOW_STATE_DIR": str(state)}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert '"run": "kept-run"' in proc.stdout and "Traceback" not in proc.stderr
    assert "starting the embedded stack" in proc.stderr and "embedded stack stopped" in proc.stderr
    assert not (state / "stack.json").exists() and list(state.glob("*.pid")) == []


def test_transfer_progress_draws_on_a_terminal_only() -> None:
    from rich.console import Console

    from astraflow.objstore.progress import transfer_progress

    class Store:
        on_read = None

    for terminal in (True, False):
        out = StringIO()
        store = Store()
        with transfer_progress(store, "v3", 2048, console=Console(file=out, force_terminal=terminal, width=80)):
            assert (store.on_read is not None) == terminal
            if store.on_read is not None:
                store.on_read(1024)
        assert store.on_read is None
        assert ("v3" in out.getvalue()) == terminal, out.getvalue()
