"""RunLayout keys follow the bucket layout in ARCHITECTURE.md; bad names are refused."""

from __future__ import annotations

import pytest

from astraflow.objstore import RunLayout, parse_version


def test_weight_keys_match_architecture() -> None:
    lay = RunLayout("run1")
    assert lay.weights_prefix("pi") == "run1/weights/pi/"
    assert lay.version_prefix("pi", 12) == "run1/weights/pi/v00000012/"
    assert lay.anchor_key("pi", 12) == "run1/weights/pi/v00000012/anchor.safetensors"
    assert lay.delta_key("pi", 13) == "run1/weights/pi/v00000013/delta.zst"
    assert lay.manifest_key("pi", 13) == "run1/weights/pi/v00000013/manifest.json"


def test_other_keys_match_architecture() -> None:
    lay = RunLayout("r-2.x")
    assert (
        lay.trainer_key("pi", "step-00000012/optimizer.pt") == "r-2.x/trainer/pi/step-00000012/optimizer.pt"
    )
    assert lay.dataflow_key("replay/state.json") == "r-2.x/dataflow/replay/state.json"
    assert lay.claim_key("ab" * 32) == "r-2.x/claims/" + "ab" * 32


def test_version_keys_sort_in_version_order() -> None:
    lay = RunLayout("r")
    keys = [lay.manifest_key("pi", v) for v in (0, 9, 10, 99, 100, 12345)]
    assert sorted(keys) == keys


@pytest.mark.parametrize("version", [0, 1, 13, 99_999_999])
def test_parse_version_round_trips(version: int) -> None:
    lay = RunLayout("r")
    for key in (lay.anchor_key("p", version), lay.delta_key("p", version), lay.manifest_key("p", version)):
        assert parse_version(key) == version
    assert parse_version(lay.version_prefix("p", version)) == version


@pytest.mark.parametrize(
    "key", ["r/weights/p/", "r/weights/p/v12/delta.zst", "r/trainer/p/v00000012/x", "nonsense", ""]
)
def test_parse_version_refuses_non_version_keys(key: str) -> None:
    with pytest.raises(ValueError, match="no weight version"):
        parse_version(key)


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "-x", "a b", "x" * 201, "é"])
def test_bad_run_and_policy_names_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid run name"):
        RunLayout(bad)
    with pytest.raises(ValueError, match="invalid policy name"):
        RunLayout("r").anchor_key(bad, 1)


@pytest.mark.parametrize("version", [-1, 100_000_000, 1.0, "3", True])
def test_bad_versions_refused(version: object) -> None:
    with pytest.raises(ValueError, match="invalid weight version"):
        RunLayout("r").delta_key("pi", version)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "/abs", "a//b", "a/../b", "./a", "a/", "sp ace"])
def test_bad_relative_names_refused(bad: str) -> None:
    lay = RunLayout("r")
    for build in (lambda n: lay.trainer_key("pi", n), lay.dataflow_key):
        with pytest.raises(ValueError, match="invalid"):
            build(bad)
    with pytest.raises(ValueError, match="invalid claim digest"):
        lay.claim_key("a/b")
