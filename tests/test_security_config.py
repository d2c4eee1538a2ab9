"""The secured cluster's files and configs without a server: the credential material's modes, the
one-file credential, what the launcher writes for its components, and who gets which role."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import yaml

from astraflow.config import ClusterConfig
from astraflow.launcher.cluster import write_cluster_file
from astraflow.launcher.plan import component_specs
from astraflow.recipe import Recipe
from astraflow.security.material import SecureMaterial
from astraflow.security.roles import ROLES, s3_actions

ROOT = Path(__file__).parent.parent


def _material(tmp_path: Path) -> SecureMaterial:
    material = SecureMaterial(tmp_path / "state")
    material.ensure(["node-host.example", "127.0.0.1"], "astraflow", "tansu")
    return material


def test_the_material_is_private_and_each_role_writes_only_its_prefixes(tmp_path):
    material = _material(tmp_path)
    assert stat.S_IMODE(material.dir.stat().st_mode) == 0o700
    files = [p for p in material.dir.rglob("*") if p.is_file()]
    assert len(files) >= 20 and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}
    assert len({keys["secret_key"] for keys in material.s3_keys().values()}) == len(ROLES)
    node = s3_actions("node", "astraflow", "tansu")
    assert node == ["Read:astraflow", "List:astraflow", "Write:astraflow/*/claims/*",
                    "Write:astraflow/*/weights/*/subscribers/*"]
    assert not any(a.startswith("Write:tansu") for a in node + s3_actions("trainer", "astraflow", "tansu"))
    assert s3_actions("reader", "astraflow", "tansu") == ["Read:astraflow", "List:astraflow"]


def test_a_credential_file_is_one_file_and_its_secrets_stay_in_it(tmp_path):
    material = _material(tmp_path)
    issued = material.credential_file("node", "node-host.example:9093", "https://node-host.example:8443", "astraflow")
    path = tmp_path / "remote" / "node.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(issued))
    cfg = ClusterConfig.load(path, env={"ASTRAFLOW_STATE_DIR": str(tmp_path / "remote" / ".astraflow")})
    assert cfg.role == "node" and cfg.credentials_file == path.absolute() and not cfg.is_embedded
    assert cfg.kafka.ssl_key_pem is None and Path(cfg.kafka.ssl_keyfile).read_text() == issued["kafka"]["ssl_key_pem"]
    assert stat.S_IMODE(Path(cfg.kafka.ssl_keyfile).stat().st_mode) == 0o600
    assert Path(cfg.s3.ca_file).read_text() == issued["s3"]["ca_pem"]

    written = write_cluster_file(cfg.model_copy(update={"run": "r1"}), tmp_path / "runs" / "r1" / "cluster.yaml")
    text = written.read_text()
    assert issued["s3"]["secret_key"] not in text and "PRIVATE KEY" not in text
    assert yaml.safe_load(text)["credentials_file"] == str(path.absolute())
    child = ClusterConfig.load(written, env={})  # a component of the run reads the secrets from the file
    assert (child.run, child.s3.secret_key, child.kafka.bootstrap) == ("r1", issued["s3"]["secret_key"],
                                                                       "node-host.example:9093")


def test_the_launcher_gives_each_component_its_roles_credential(tmp_path):
    material = _material(tmp_path)
    recipe = Recipe.load(ROOT / "examples" / "recipes" / "math.yaml")
    specs = component_specs(recipe, tmp_path / "r.yaml", tmp_path / "c.yaml", tmp_path,
                            credentials_dir=material.credentials_file("node").parent)
    roles = {spec.name: Path(spec.env["ASTRAFLOW_CREDENTIALS_FILE"]).stem for spec in specs}
    assert roles == {"dataflow": "dataflow", "trainer-policy": "trainer", "raas-default-0": "node",
                     "archive": "archiver"}
    assert all("ASTRAFLOW_CREDENTIALS_FILE" not in spec.env for spec in
               component_specs(recipe, tmp_path / "r.yaml", tmp_path / "c.yaml", tmp_path))


def test_a_policy_trainer_writes_its_policy_only_and_the_launcher_hands_it_its_key(tmp_path):
    material = _material(tmp_path)
    assert material.ensure_policy_trainers(["pi", "ref"], "astraflow", "tansu") == ["trainer-pi", "trainer-ref"]
    assert material.ensure_policy_trainers(["pi"], "astraflow", "tansu") == []  # kept
    assert s3_actions("trainer-pi", "astraflow", "tansu") == [
        "Read:astraflow", "List:astraflow", "Write:astraflow/*/weights/pi/*", "Write:astraflow/*/trainer/pi/*",
        "Write:astraflow/*/claims/*"]
    identities = {i["name"]: i for i in json.loads(material.identities_file.read_text())["identities"]}
    assert set(identities) == {*ROLES, "trainer-pi", "trainer-ref"}
    assert identities["trainer-pi"]["credentials"][0]["secretKey"] == material.s3_keys()["trainer-pi"]["secret_key"]
    material.ensure(["node-host.example", "127.0.0.1"], "astraflow", "tansu")  # a later `up --secure` keeps them
    assert {i["name"] for i in json.loads(material.identities_file.read_text())["identities"]} == set(identities)
    assert {stat.S_IMODE(p.stat().st_mode) for p in material.dir.rglob("*") if p.is_file()} == {0o600}

    recipe = Recipe.load(ROOT / "examples" / "recipes" / "math.yaml")
    pi = recipe.policies[0].model_copy(update={"name": "pi"})
    specs = component_specs(recipe.model_copy(update={"policies": [pi]}), tmp_path / "r.yaml", tmp_path / "c.yaml",
                            tmp_path, credentials_dir=material.credentials_file("node").parent)
    roles = {spec.name: Path(spec.env["ASTRAFLOW_CREDENTIALS_FILE"]).stem for spec in specs}
    assert roles["trainer-pi"] == "trainer-pi" and roles["raas-default-0"] == "node"
