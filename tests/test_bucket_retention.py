"""The bucket stays bounded during a long run, on the real embedded S3: the trainer keeps its K newest
checkpoints (older step folders deleted once the new pointer is written), and the weight publisher
runs the weight GC (``astraflow weights gc``'s rule) every N versions while live subscribers keep
their chains."""

from __future__ import annotations

import time

import pytest
import torch
from pydantic import ValidationError

from astraflow.delta import WeightPublisher, WeightStore, WeightSubscriber
from astraflow.objstore import ObjectStore
from astraflow.recipe import TrainerSpec
from astraflow.records.control import TrainerStep
from astraflow.trainer.checkpoint import STEP_DIR_RE, CheckpointError, CheckpointStore, TrainerCheckpoint

pytestmark = pytest.mark.integration
POLICY = "pi"


def _step_folders(store: ObjectStore, ckpts: CheckpointStore) -> dict[int, set[str]]:
    root = ckpts.layout.trainer_prefix(POLICY)
    folders: dict[int, set[str]] = {}
    for key in store.list(root):
        match = STEP_DIR_RE.match(key[len(root):])
        if match:
            folders.setdefault(int(match.group(1)), set()).add(key.rsplit("/", 1)[1])
    return folders


def test_checkpoint_store_keeps_the_newest_k(test_cluster):
    store = ObjectStore.from_config(test_cluster)
    ckpts = CheckpointStore(store, test_cluster.run, POLICY, keep_checkpoints=2)
    # A crashed save's leftover above the pointer's step: not the pointer's past, left alone.
    stray = ckpts._key("step-00000090/model.safetensors")
    store.put_bytes(stray, b"a save that never got its pointer")
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 6):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        ckpts.save(TrainerCheckpoint(step=step, version=step, model_state=model.state_dict(),
                                     optimizer_state=opt.state_dict(), offsets={"t:0": step}))
    parts = {"model.safetensors", "optimizer.safetensors", "optimizer.json", "pointer.json"}
    assert _step_folders(store, ckpts) == {4: parts, 5: parts, 90: {"model.safetensors"}}
    assert ckpts.pruned_steps == 3
    got = ckpts.load()
    assert (got.step, got.version, got.offsets) == (5, 5, {"t:0": 5})
    assert all(torch.equal(got.model_state[k], v) for k, v in model.state_dict().items())

    # What a rollback may go back to: the kept steps (the stray has no pointer), the oldest one's offsets
    # (the trainer holds them in the log), each loadable by step; a step not kept is refused by name.
    assert ckpts.kept_steps() == [4, 5]
    assert (ckpts.oldest_kept, ckpts.oldest_kept_offsets()) == (4, {"t:0": 4})
    assert ckpts.load(4).offsets == {"t:0": 4} and ckpts.load(3) is None
    with pytest.raises(CheckpointError, match=r"no kept checkpoint at step 3 .*kept: \[4, 5\]"):
        ckpts.roll_back(3)
    assert ckpts.load().step == 5
    # The kept older checkpoint is a rollback away: its pointer copied over latest.json.
    assert ckpts.roll_back(4)["step"] == 4
    assert ckpts.load().step == 4
    # A store of a later life reads the oldest kept checkpoint's offsets from the bucket.
    later = CheckpointStore(store, test_cluster.run, POLICY, keep_checkpoints=2)
    later.save(TrainerCheckpoint(step=5, version=6, model_state=model.state_dict(), optimizer_state=None,
                                 offsets={"t:0": 5}))
    assert (later.oldest_kept, later.oldest_kept_offsets()) == (4, {"t:0": 4})


def test_a_rollback_to_a_step_a_policy_does_not_keep_changes_nothing(test_cluster, tmp_path):
    """``astraflow run --from-checkpoint``'s step (alone: ``astraflow runs rollback``): every policy must
    keep it, or no pointer moves."""
    import subprocess
    import sys

    from astraflow.launcher.cluster import write_cluster_file
    from astraflow.launcher.rollback import roll_back

    store = ObjectStore.from_config(test_cluster)
    stores = {n: CheckpointStore(store, test_cluster.run, n, keep_checkpoints=2) for n in ("a", "b")}
    for name, steps in (("a", (1, 2, 3)), ("b", (2, 3))):
        for step in steps:
            stores[name].save(TrainerCheckpoint(step=step, version=step, model_state={"w": torch.zeros(1)},
                                                optimizer_state=None, offsets={f"t.{name}:0": step}))
    said: list[str] = []
    with pytest.raises(CheckpointError, match=r"cannot roll back to checkpoint step 1: policy a keeps steps "
                                              r"\[2, 3\]; policy b keeps steps \[2, 3\]"):
        roll_back(test_cluster, ["a", "b"], 1, said.append)
    assert [s.load().step for s in stores.values()] == [3, 3] and said == []
    roll_back(test_cluster, ["a", "b"], 2, said.append)
    assert [s.load().step for s in stores.values()] == [2, 2] and len(said) == 2, said
    # the command line, for trainers started by something else: the policies from the bucket
    env = {"ASTRAFLOW_CONFIG": str(write_cluster_file(test_cluster, tmp_path / "cluster.yaml")), "PATH": "/usr/bin:/bin"}

    def rollback(step: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "astraflow.cli.main", "runs", "rollback", test_cluster.run,
                               str(step)], env=env, capture_output=True, text=True, timeout=60, check=False)

    refused, done = rollback(1), rollback(3)
    assert refused.returncode == 1 and "policy a keeps steps [2, 3]" in refused.stderr, refused.stderr
    assert done.returncode == 0 and "a: rolled back to checkpoint step 3" in done.stdout, done.stderr
    assert [s.load().step for s in stores.values()] == [3, 3]


def test_recipe_retention_fields_are_bounded():
    spec = TrainerSpec()
    assert (spec.keep_checkpoints, spec.weights_gc_every) == (2, 10)
    assert TrainerSpec(weights_gc_every=0).weights_gc_every == 0
    with pytest.raises(ValidationError, match="keep_checkpoints"):
        TrainerSpec(keep_checkpoints=0)
    with pytest.raises(ValidationError, match="weights_gc_every"):
        TrainerSpec(weights_gc_every=-1)


def _nudge(state: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The next version: ~2% of the bf16 weights moved by one ulp (a sparse delta), as a step does."""
    out = {}
    for name, t in state.items():
        bits = t.clone().view(torch.int16)
        hit = torch.rand(bits.shape, generator=gen) < 0.02
        bits[hit] += 1
        out[name] = bits.view(torch.bfloat16)
    return out


def _assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(got[name].view(torch.int16), w.view(torch.int16)), name


@pytest.mark.slow
def test_weights_gc_runs_while_publishing_and_keeps_live_chains(test_cluster):
    gen = torch.Generator().manual_seed(0)
    state = {"embed": torch.randn(256, 64, generator=gen).to(torch.bfloat16),
             "head": torch.randn(64, 128, generator=gen).to(torch.bfloat16)}
    truth = {}
    store = WeightStore.from_config(test_cluster, POLICY)
    with WeightPublisher(test_cluster, POLICY, anchor_every=10, gc_every=5, announce=False) as pub:
        for v in range(25):
            if v:
                state = _nudge(state, gen)
            truth[v] = state
            pub.publish(state, v)
            if v == 12:
                # Versions 0..12 published (GCs after 5 and 10 kept them: anchor v0's chain). A live
                # subscriber takes v12 and registers there; a dead one (stale heartbeat) sits at v1.
                pub.flush()
                slow = WeightSubscriber(test_cluster, POLICY, "slow")
                _, at, _ = slow.pull(12)
                assert at == 12
                store.register_subscriber("dead", 1, now=time.time() - 3600)
    # close() waited for the GCs: the last one ran after v24 (anchor v20; the live chain 13..24).
    assert store.versions() == list(range(13, 25))
    left = list(store.objects.list(store.prefix))
    assert not any(f"/v{v:08d}/" in key for key in left for v in range(13))
    assert not any(key.endswith("/dead.json") for key in left)
    assert any(key.endswith("/slow.json") for key in left)
    assert pub.gc_totals["versions"] == 13 and pub.gc_totals["subscribers"] == 1
    assert pub.gc_totals["failed"] == 0 and 1 <= pub.gc_totals["runs"] <= 5

    # The live subscriber catches up by its kept delta chain; a new one from the latest anchor.
    got, at, nbytes = slow.pull()
    assert at == 24 and nbytes == sum(store.manifest(v).delta_bytes for v in range(13, 25))
    _assert_bits_equal(got, truth[24])
    fresh = WeightSubscriber(test_cluster, POLICY, "fresh")
    got, at, _ = fresh.pull()
    assert at == 24
    _assert_bits_equal(got, truth[24])
    slow.close()
    fresh.close()


@pytest.mark.slow
def test_a_trainer_run_prunes_its_checkpoints_and_weights(test_cluster):
    """The recipe's fields reach a real trainer (tiny model, real broker and bucket): 12 steps with a
    checkpoint every 2 and a weight GC every 5 versions leave 2 checkpoints and no version below the
    GC's anchor, and the step records count the deletions."""
    import threading

    from raas_support import make_recipe, send_batches

    from astraflow.log import Topics
    from astraflow.log.range_reader import read_to_end
    from astraflow.trainer.service import run_trainer

    cfg = test_cluster
    send_batches(cfg, [f"b{i}" for i in range(12)])
    recipe = make_recipe(cfg.run, trainer={"steps": 12, "checkpoint_every": 2, "anchor_every": 5,
                                           "keep_checkpoints": 2, "weights_gc_every": 5})
    result = run_trainer(cfg, recipe, "policy", threading.Event(), poll_timeout_s=0.2)
    assert result["finished"] and result["version"] == 12

    store = ObjectStore.from_config(cfg)
    ckpts = CheckpointStore(store, cfg.run, "policy")
    root = ckpts.layout.trainer_prefix("policy")
    steps = {int(m.group(1)) for k in store.list(root) if (m := STEP_DIR_RE.match(k[len(root):]))}
    assert steps == {10, 12} and ckpts.load().step == 12
    # v0..v12 published; the GC after the 10th ran at latest v9 or later: v0..v4 at least are gone.
    versions = WeightStore.from_config(cfg, "policy").versions()
    assert versions[-1] == 12 and versions[0] in (5, 10) and versions == list(range(versions[0], 13))
    sub = WeightSubscriber(cfg, "policy", "after-run", register=False)
    assert sub.pull()[1] == 12

    records = [m.record for m in read_to_end(cfg, {(Topics(cfg.run).metrics, 0): 0}).messages
               if isinstance(m.record, TrainerStep)]
    assert len(records) == 12
    gc_deleted = [r.weights_gc_deleted for r in records]  # this life's totals as each step was reported
    ckpt_deleted = [r.checkpoints_deleted for r in records]
    assert gc_deleted == sorted(gc_deleted) and gc_deleted[-1] <= versions[0]
    assert ckpt_deleted == sorted(ckpt_deleted) and 0 < ckpt_deleted[-1] <= 4
    print("weights_gc_deleted", gc_deleted, "checkpoints_deleted", ckpt_deleted)
