"""TorchBackend: a step changes the weights and lowers the loss on a fixed batch; state round trip."""

import torch

from astraflow.models import build_model, build_tokenizer
from astraflow.records import Trajectory
from astraflow.trainer import BackendConfig, TorchBackend
from astraflow.trainer.loss import group_advantages, policy_loss

TINY = "examples/models/tiny.yaml"


def _batch(model):
    """A fixed batch: 2 groups x 4 samples with varied rewards; behaviour log-probs from the model."""
    tok = build_tokenizer()
    out = []
    for g, text in enumerate(["max 3 7 1 =", "min 4 2 9 5 ="]):
        prompt = [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]
        for i, resp in enumerate([[12], [8], [5, 2], [9]]):
            resp = [*resp, tok.eos_token_id]
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=torch.tensor([prompt + resp])).logits[0], -1)
            out.append(Trajectory(
                episode_id=f"p{g}/policy/{i}", task_id=f"p{g}", group_id=f"p{g}/policy", sample_index=i,
                policy="policy", prompt_ids=prompt, response_ids=resp,
                logprobs=[float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(resp)],
                versions=[0] * len(resp), loss_mask=[1] * len(resp), reward=float(i % 2 == 0),
                rewards={}, turn_bounds=[0, len(resp)], node_id="n", created_at=0.0, gen_seconds=0.0,
                task_type="math"))
    return out


def _loss(backend, trajs):
    ids, attn, gpos, behav, mask = backend._tensors(trajs)
    with torch.no_grad():
        logp = backend.token_logprobs(ids, attn, gpos)
    adv = torch.tensor(group_advantages([t.reward for t in trajs], [t.group_id for t in trajs]))
    return float(policy_loss(logp, behav, behav, adv, mask)[0])


def test_step_changes_weights_and_lowers_loss():
    torch.manual_seed(0)
    backend = TorchBackend(build_model(TINY), BackendConfig(lr=1e-3))
    trajs = _batch(backend.model)
    before = backend.state_dict()
    loss0 = _loss(backend, trajs)
    m = backend.step(trajs)
    after = backend.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for _ in range(3):
        backend.step(trajs)
    assert _loss(backend, trajs) < loss0
    assert m["reward_mean"] == 0.5 and m["grad_norm"] > 0
    assert abs(m["is_weight_mean"] - 1.0) < 1e-4  # behaviour == current weights: on-policy
    assert all(v.dtype == torch.bfloat16 for v in backend.state_dict(torch.bfloat16).values())


def test_recomputed_logprobs_match_behaviour_on_policy():
    backend = TorchBackend(build_model(TINY))
    trajs = _batch(backend.model)
    ids, attn, gpos, behav, mask = backend._tensors(trajs)
    with torch.no_grad():
        logp = backend.token_logprobs(ids, attn, gpos)
    assert torch.allclose(logp * mask, behav * mask, atol=1e-5)


def test_state_round_trip_resumes_identically():
    a = TorchBackend(build_model(TINY), {"lr": 1e-3})
    trajs = _batch(a.model)
    a.step(trajs)
    b = TorchBackend(build_model(TINY), {"lr": 1e-3})
    b.load_state(a.state_dict(), a.optimizer_state_dict())
    a.step(trajs)
    b.step(trajs)
    for k, v in a.state_dict().items():
        assert torch.allclose(v, b.state_dict()[k], atol=1e-6)


def test_minibatches_make_the_clip_active():
    backend = TorchBackend(build_model(TINY), {"lr": 5e-3, "minibatches": 4, "clip_eps": 0.01})
    trajs = _batch(backend.model)
    m = backend.step(trajs)
    assert m["clip_frac"] > 0  # later minibatches see a policy that moved away from the proximal one
