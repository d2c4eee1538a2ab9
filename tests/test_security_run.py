"""A secured run with a remote-style node (docs/security.md): the node joins from another state dir and
process with the one file `astraflow credentials issue node` wrote, the run finishes through the TLS
listeners, and no secret shows in the run dir, the components' and servers' logs, the archive or the
process arguments."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from e2e_helpers import free_block_plan, tiny_recipe
from waiting import wait_until

from astraflow.config import ClusterConfig
from astraflow.embedded.supervisor import SupervisedProcess
from astraflow.objstore import ObjectStore, RunLayout
from astraflow.records.control import TrainerDone, TrainerStep
from astraflow.report.plot import typed_records
from astraflow.security.material import SecureMaterial

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CLI = [sys.executable, "-m", "astraflow.cli.main"]


def _secrets(material: SecureMaterial) -> list[str]:
    """Every S3 secret key and every private key's body of the stack."""
    found = [keys["secret_key"] for keys in material.s3_keys().values()]
    for key_file in [*material.dir.glob("clients/*.key"), material.dir / "ca.key", material.server_key_file]:
        body = "".join(line for line in key_file.read_text().splitlines() if not line.startswith("-----"))
        found.append(body[20:60])  # a slice of the base64 body is enough to find it anywhere
    return found


def _leaks(secrets: list[str], text: str) -> list[str]:
    return [s[:6] + "..." for s in secrets if s in text]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}


def test_a_remote_node_joins_with_one_file_and_nothing_leaks(secure_stack, tmp_path: Path, unique_name) -> None:
    material = SecureMaterial(secure_stack.state_dir)
    secrets = _secrets(material)
    remote = tmp_path / "remote"  # "another machine": its own working and state dir
    remote.mkdir()
    issued = subprocess.run([*CLI, "credentials", "issue", "node", "--out", str(remote / "node.yaml"),
                             "--state-dir", str(secure_stack.state_dir)], env=_env(), capture_output=True, text=True, check=False)
    assert issued.returncode == 0, issued.stderr
    assert stat.S_IMODE((remote / "node.yaml").stat().st_mode) == 0o600
    node_file = yaml.safe_load((remote / "node.yaml").read_text())
    assert node_file["kafka"]["bootstrap"] == secure_stack.kafka_bootstrap and node_file["s3"]["endpoint"].startswith("https")
    assert node_file["kafka"]["fetch_max_wait_ms"] == 20  # the embedded in-memory log's, not kafka-python's 500
    assert not _leaks(secrets, issued.stdout + issued.stderr)

    run_id = unique_name("secure-run")
    recipe = tiny_recipe(tmp_path, steps=2)
    launcher_out = tmp_path / "launcher.out"
    launcher = subprocess.Popen(
        [*CLI, "run", str(recipe), "--run-id", run_id, "--runs-dir", str(tmp_path / "runs"), "--no-live",
         "--timeout", "150", "--state-dir", str(secure_stack.state_dir), "--nodes", "default=0"],
        env=_env(), stdout=launcher_out.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path)
    node_out = remote / "node.out"
    node = subprocess.Popen([*CLI, "node", "--cluster", "node.yaml", "--recipe", str(recipe), "--run-id", run_id,
                             "--pool", "default", "--node-id", "remote-1"],
                            env=_env(), stdout=node_out.open("w"), stderr=subprocess.STDOUT, cwd=remote)
    try:
        processes = wait_until(lambda: _astraflow_processes(run_id), 60, "the run's components started",
                               on_timeout=lambda: launcher_out.read_text()[-3000:] + node_out.read_text()[-3000:])
        secrets = _secrets(material)  # with the trainer's key scoped to its policy, made by the launcher
        assert not _leaks(secrets, processes), processes  # what `ps` shows of every component
        rc = launcher.wait(timeout=180)
        assert rc == 0, launcher_out.read_text()[-3000:] + node_out.read_text()[-2000:]
    finally:
        for proc in (node, launcher):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)

    # The launcher started no node: every trajectory the trainer stepped on came from the remote one.
    run_dir = tmp_path / "runs" / run_id
    records = typed_records([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                             if line.endswith("}")])
    assert max(r.step for r in records if isinstance(r, TrainerStep)) == 2
    assert "trainer-policy" in material.s3_keys()  # the run's trainer wrote with its policy's key
    assert any(isinstance(r, TrainerDone) for r in records)
    cluster = yaml.safe_load((run_dir / "cluster.yaml").read_text())
    assert cluster["credentials_file"] == str(material.credentials_file("admin")) and "secret_key" not in cluster["s3"]
    texts = {str(p): p.read_bytes().decode(errors="replace") for p in run_dir.rglob("*") if p.is_file()}
    texts["launcher output"], texts["node output"] = launcher_out.read_text(), node_out.read_text()
    texts.update({str(p): p.read_text(errors="replace") for p in (secure_stack.state_dir / "logs").glob("*.log")})
    admin = ObjectStore.from_config(ClusterConfig.load(env={"ASTRAFLOW_STATE_DIR": str(secure_stack.state_dir),
                                                            "ASTRAFLOW_RUN": run_id}).resolve())
    for key in admin.list(RunLayout(run_id).archive_prefix()):
        texts[key] = admin.get_bytes(key).decode(errors="replace")
    leaks = {where: _leaks(secrets, text) for where, text in texts.items() if _leaks(secrets, text)}
    assert not leaks, leaks


def _astraflow_processes(run_id: str) -> str:
    """The arguments of every process of the run, once its trainer and the remote node are up."""
    out = subprocess.run(["ps", "-eww", "-o", "args"], check=True, capture_output=True, text=True).stdout
    mine = "\n".join(line for line in out.splitlines() if "astraflow" in line or "stunnel" in line or "tansu" in line)
    return mine if "remote-1" in mine and "trainer" in mine else ""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, check=False,
                          env={**_env(), "COLUMNS": "200"})


def test_up_secure_keeps_its_secrets_in_private_files_and_down_stops_the_terminator(tmp_path: Path) -> None:
    state, ports = tmp_path / "state", free_block_plan()
    up = _cli("up", "--secure", "--state-dir", str(state), "--log-storage", "memory", "--kafka-port", str(ports.kafka),
              "--s3-port", str(ports.s3), "--internal-port-base", str(ports.master))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        material = SecureMaterial(state)
        assert "operator credential" in up.stdout and not _leaks(_secrets(material), up.stdout + up.stderr)
        stack = json.loads((state / "stack.json").read_text())
        assert stack["kafka_bootstrap"] == f"127.0.0.1:{ports.kafka}" and stack["s3_endpoint"] == f"https://127.0.0.1:{ports.s3}"
        assert "s3_secret_key" not in stack and stack["credentials_file"] == str(material.credentials_file("admin"))
        assert {stat.S_IMODE(p.stat().st_mode) for p in material.dir.rglob("*") if p.is_file()} == {0o600}
        status = _cli("status", "--state-dir", str(state))
        assert status.returncode == 0 and "tls (stunnel)" in status.stdout, status.stdout
        assert "SSL" in status.stdout  # the resolved config the components will use
        (tmp_path / "taken.yaml").write_text("keep me")
        refused = _cli("credentials", "issue", "node", "--out", str(tmp_path / "taken.yaml"), "--state-dir", str(state))
        assert refused.returncode == 2 and (tmp_path / "taken.yaml").read_text() == "keep me"
    finally:
        down = _cli("down", "--state-dir", str(state))
    assert down.returncode == 0 and "stunnel" in down.stdout, down.stdout
    assert not any(SupervisedProcess(name, state).alive() for name in ("stunnel", "tansu", "seaweedfs"))
