"""The torch backend as a group of ranks (FSDP2 on gloo, CPU), launched by torch's own elastic agent:
one step on 2 ranks agrees with one step on 1 rank, and checkpoints written through
torch.distributed.checkpoint into the real bucket resume at another world size (2 -> 1 -> 2)."""

from __future__ import annotations

import pytest
from process_helpers import launch_ranks
from raas_support import load_tiny_model
from update_agreement import update_disagreement

pytestmark = pytest.mark.slow


def _batch(rewards: list[list[float]], tag: str = "b"):
    """Groups of trajectories with the given rewards (a group with equal rewards has advantage 0)."""
    from astraflow.records import Trajectory

    trajs = []
    for g, group in enumerate(rewards):
        for s, reward in enumerate(group):
            resp = [8 + s + g, 9, 2 + s, 10 + g][: 3 + (s + g) % 2]
            trajs.append(Trajectory(
                episode_id=f"{tag}{g}-{s}", task_id=f"{tag}{g}", group_id=f"{tag}{g}", sample_index=s, policy="p",
                prompt_ids=[1, 5 + g, 6, 7], response_ids=resp, logprobs=[-2.0] * len(resp),
                versions=[0] * len(resp), loss_mask=[1] * len(resp), reward=reward))
    return trajs


STEP_CASES = {
    # 4 trained rows: 2 per rank, one group left out for its zero advantage
    "rows split": ({"lr": 1e-3}, [[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
    # one trained row: rank 1 forwards a filler (advantage and mask 0) to join the collectives
    "filler rank": ({"lr": 1e-3}, [[0.0, 1.0], [1.0, 1.0]]),
    # two optimizer steps per batch: proximal log-probs, the PPO clip active
    "minibatches": ({"lr": 1e-2, "minibatches": 2}, [[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]),
    # a non-default objective: every row trained (KL and entropy terms), sequence-mean weights per rank,
    # the frozen reference sharded like the policy and loaded from rank 0's full state
    "objective": ({"lr": 1e-2, "objective": {"advantage": "rloo", "aggregation": "seq_mean", "dual_clip": 2.0,
                                              "entropy_coef": 0.01, "kl": {"coef": 0.5, "estimator": "k1"}}},
                  [[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
    # the KL folded into the reward: every rank forwards the whole batch through the sharded reference
    "kl in the reward": ({"lr": 1e-2, "objective": {"advantage": "reinforce_pp", "aggregation": "seq_mean_token_sum",
                                                     "norm_tokens": 4, "overlong": {"max_tokens": 4, "buffer": 1},
                                                     "kl": {"coef": 0.5, "estimator": "k3", "mode": "reward"}}},
                         [[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
}


def _perturbed(state: dict) -> dict:
    """A reference policy other than the initial weights (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(4)
    return {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def _steps_on_group(cases: dict) -> dict:
    from astraflow.trainer.distributed import current_group
    from astraflow.trainer.torch_backend import TorchBackend

    group = current_group()
    group.start("cpu")
    out = {}
    for name, (options, rewards) in cases.items():
        backend = TorchBackend(load_tiny_model(), options)
        if backend.wants_reference:
            backend.set_reference(_perturbed(load_tiny_model().state_dict()) if group.leader else {})
        metrics = backend.step(_batch(rewards))
        out[name] = (metrics, backend.state_dict())
    group.close()
    return out


def test_one_step_on_two_ranks_is_the_step_on_one_rank():
    from astraflow.trainer.distributed import SINGLE
    from astraflow.trainer.torch_backend import TorchBackend

    start = load_tiny_model().state_dict()
    group = launch_ranks(_steps_on_group, 2, STEP_CASES)
    for name in STEP_CASES:  # every rank reports the group's metrics; the full state is on rank 0 only
        timeless = [{k: v for k, v in group[r][name][0].items() if k != "step_seconds"} for r in (0, 1)]
        assert timeless[0] == timeless[1] and group[1][name][1] == {}, name
    for name, (options, rewards) in STEP_CASES.items():
        one = TorchBackend(load_tiny_model(), options, group=SINGLE)
        if one.wants_reference:
            one.set_reference(_perturbed(load_tiny_model().state_dict()))
        m1 = one.step(_batch(rewards))
        m2, state = group[0][name]
        expected = one.state_dict()
        assert list(state) == list(expected), name  # HF names, HF order (the tied lm_head included)
        assert update_disagreement(start, expected, state) < 1e-4, name  # 2-3e-6 on 2 CPU cores
        for key in ("loss", "grad_norm", "clip_frac", "behav_kl", "trained_trajectories", "tokens", "entropy",
                    "kl_ref", "dual_clip_frac", "shaped_reward_mean", "overlong_penalty_mean"):
            assert (key in m2) == (key in m1), (name, key)
            if key in m1:
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), (name, key)
    assert group[0]["objective"][0]["kl_ref"] != 0.0  # the reference is not the initial policy
    assert group[0]["kl in the reward"][0]["kl_ref"] > 0.0


# -- checkpoints through torch.distributed.checkpoint, resharded ----------------------------------
def _save(backend, group, cluster, step: int):
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointStore, TrainerCheckpoint
    from astraflow.trainer.sharded_checkpoint import write_local

    shards = write_local(backend.sharded_state(), group, f"test-{step}")
    store = CheckpointStore(ObjectStore.from_config(cluster), cluster.run, "p")
    return store.save(TrainerCheckpoint(step=step, version=step, model_state={}, optimizer_state=None,
                                        offsets={"t:0": step}, batch_ids=[f"b{step}"], local_shards=shards))


def _resume(backend, group, cluster):
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointStore
    from astraflow.trainer.sharded_checkpoint import restore

    store = CheckpointStore(ObjectStore.from_config(cluster), cluster.run, "p")
    ckpt = store.load()
    restore(store, ckpt, backend, group)
    return ckpt


def _two_ranks_save_then_step(cluster):
    """Step, checkpoint (step 1), step again; rank 0 returns the full state after each step."""
    from astraflow.trainer.distributed import current_group
    from astraflow.trainer.torch_backend import TorchBackend

    group = current_group()
    group.start("cpu")
    backend = TorchBackend(load_tiny_model(), {"lr": 1e-2})
    backend.step(_batch([[0.0, 1.0], [1.0, 0.0]], "x"))
    saved = backend.state_dict()
    pointer = _save(backend, group, cluster, 1)
    backend.step(_batch([[1.0, 0.0], [0.0, 1.0]], "y"))
    after = backend.state_dict()
    group.close()
    return saved, after, pointer


def _two_ranks_resume_then_step(cluster):
    from astraflow.trainer.distributed import current_group
    from astraflow.trainer.torch_backend import TorchBackend

    group = current_group()
    group.start("cpu")
    backend = TorchBackend(load_tiny_model(), {"lr": 1e-2})
    ckpt = _resume(backend, group, cluster)
    resumed = backend.state_dict()
    backend.step(_batch([[0.0, 1.0], [1.0, 0.0]], "z"))
    after = backend.state_dict()
    group.close()
    return ckpt.step, ckpt.stored_shards.world_size, resumed, after


def test_a_two_rank_checkpoint_resumes_on_one_rank_and_a_one_rank_checkpoint_on_two(test_cluster):
    import torch

    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointError, CheckpointStore
    from astraflow.trainer.distributed import SINGLE
    from astraflow.trainer.torch_backend import TorchBackend

    def same(a, b):
        return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)

    # 2 ranks write step 1 (each rank its shards); 1 rank resumes it and takes the same next step
    saved, after_two, pointer = launch_ranks(_two_ranks_save_then_step, 2, test_cluster)[0]
    assert pointer["format"] == 3 and pointer["world_size"] == 2
    assert {f["key"].rsplit("/", 2)[1] for f in pointer["parts"]["shards"]} == {"rank-00000", "rank-00001"}
    one = TorchBackend(load_tiny_model(), {"lr": 1e-2}, group=SINGLE)
    ckpt = _resume(one, SINGLE, test_cluster)
    assert (ckpt.step, ckpt.offsets, ckpt.batch_ids) == (1, {"t:0": 1}, ["b1"])
    assert same(one.state_dict(), saved)  # the fp32 masters, bit for bit
    one.step(_batch([[1.0, 0.0], [0.0, 1.0]], "y"))
    # the optimizer's moments came back too: the second step is the one the 2 ranks took
    assert update_disagreement(saved, after_two, one.state_dict()) < 1e-4

    # 1 rank writes step 2; 2 ranks resume it and take the same next step as the 1 rank
    pointer = _save(one, SINGLE, test_cluster, 2)
    assert pointer["world_size"] == 1
    resumed_at = one.state_dict()
    step, written_by, resumed, after = launch_ranks(_two_ranks_resume_then_step, 2, test_cluster)[0]
    assert (step, written_by) == (2, 1) and same(resumed, resumed_at)
    one.step(_batch([[0.0, 1.0], [1.0, 0.0]], "z"))
    assert update_disagreement(resumed_at, one.state_dict(), after) < 1e-4

    # a shard replaced behind the pointer's back (a valid object, other bytes) is refused, named
    store = ObjectStore.from_config(test_cluster)
    shard = pointer["parts"]["shards"][0]["key"]
    store.put_bytes(shard, b"not a shard")
    fresh = TorchBackend(load_tiny_model(), {"lr": 1e-2}, group=SINGLE)
    with pytest.raises(CheckpointError, match=f"{shard} does not match the sha256"):
        _resume(fresh, SINGLE, test_cluster)
    # and a pointer whose shard list is not one is refused before anything is read
    ckpts = CheckpointStore(store, test_cluster.run, "p")
    store.put_json(ckpts._key("latest.json"), {**pointer, "parts": {"shards": "x", "extras": {}}})
    with pytest.raises(CheckpointError, match="not a format-3 pointer"):
        ckpts.load()


def _load_full_state_then_step(model_state, optimizer_state):
    import torch

    from astraflow.trainer.distributed import current_group
    from astraflow.trainer.torch_backend import TorchBackend

    group = current_group()
    group.start("cpu")
    backend = TorchBackend(load_tiny_model(), {"lr": 1e-2})
    backend.load_state(model_state if group.leader else {}, optimizer_state if group.leader else None)
    # the caller's state is left as it was (the weight store's copy is the publisher's delta base)
    assert all(type(t) is torch.Tensor for t in model_state.values())
    loaded = backend.state_dict()
    backend.step(_batch([[0.0, 1.0], [1.0, 0.0]], "y"))
    after = backend.state_dict()
    group.close()
    return loaded, after


def test_full_single_rank_state_is_broadcast_into_the_shards():
    """What a group loads that is not sharded: a single-rank (format-2) checkpoint, whose AdamW state
    is keyed by parameter index, and bf16 weights from the weight store; rank 0's copy reaches all."""
    import torch

    from astraflow.trainer.distributed import SINGLE
    from astraflow.trainer.torch_backend import TorchBackend

    one = TorchBackend(load_tiny_model(), {"lr": 1e-2}, group=SINGLE)
    one.step(_batch([[0.0, 1.0], [1.0, 0.0]], "x"))
    model_state, optimizer_state = one.state_dict(), one.optimizer_state_dict()
    loaded, after = launch_ranks(_load_full_state_then_step, 2, model_state, optimizer_state)[0]
    assert all(torch.equal(loaded[k], model_state[k]) for k in model_state)
    one.step(_batch([[0.0, 1.0], [1.0, 0.0]], "y"))
    assert update_disagreement(model_state, one.state_dict(), after) < 1e-4  # the moments came along
    served = {k: v.to(torch.bfloat16) for k, v in model_state.items()}
    loaded, _ = launch_ranks(_load_full_state_then_step, 2, served, None)[0]
    assert all(torch.equal(loaded[k], served[k].float()) for k in served)


def _fsdp_step_on_cuda(options: dict, rewards: list) -> dict:
    from astraflow.trainer.distributed import current_group
    from astraflow.trainer.torch_backend import TorchBackend

    group = current_group()
    group.start("cuda")
    backend = TorchBackend(load_tiny_model(), {**options, "device": "cuda"})
    metrics = backend.step(_batch(rewards))
    state = backend.state_dict()
    group.close()
    return {"metrics": metrics, "state": state}


def test_one_fsdp2_rank_on_cuda_is_the_plain_backend():
    """The NCCL path (one rank: the CI machine has one GPU) agrees with the plain backend on CUDA."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from astraflow.trainer.distributed import SINGLE
    from astraflow.trainer.torch_backend import TorchBackend

    options, rewards = STEP_CASES["rows split"]
    start = load_tiny_model().state_dict()
    plain = TorchBackend(load_tiny_model(), {**options, "device": "cuda"}, group=SINGLE)
    m1 = plain.step(_batch(rewards))
    got = launch_ranks(_fsdp_step_on_cuda, 1, options, rewards)[0]
    assert update_disagreement(start, plain.state_dict(), got["state"]) < 1e-3
    assert got["metrics"]["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)
