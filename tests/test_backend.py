"""TorchBackend: a step changes the weights and lowers the loss on a fixed batch; state round trip.
The backend section: typed options per ``type``, refused typos, no runtime imported to validate."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from update_agreement import update_disagreement

from astraflow.config import ConfigError
from astraflow.models import load_model
from astraflow.records import Trajectory
from astraflow.trainer.backend import build_backend
from astraflow.trainer.config import SimulatedBackendConfig, TorchBackendConfig, parse_backend
from astraflow.trainer.loss import group_advantages, policy_loss
from astraflow.trainer.torch_backend import TorchBackend


@pytest.fixture
def new_model(tiny_checkpoint):
    """A factory of fresh copies of the tiny model (identical weights)."""
    return lambda: load_model(tiny_checkpoint)


def _batch(model, tok):
    """A fixed batch: 2 groups x 4 samples with varied rewards; behaviour log-probs from the model."""
    out = []
    for g, text in enumerate(["max 3 7 1 =", "min 4 2 9 5 ="]):
        prompt = tok.encode(text, add_special_tokens=False)
        for i, resp in enumerate([[12], [8], [5, 20], [9]]):
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


def test_step_changes_weights_and_lowers_loss(new_model, tiny_tokenizer):
    torch.manual_seed(0)
    backend = TorchBackend(new_model(), TorchBackendConfig(lr=1e-3))
    trajs = _batch(backend.model, tiny_tokenizer)
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


def test_recomputed_logprobs_match_behaviour_on_policy(new_model, tiny_tokenizer):
    backend = TorchBackend(new_model())
    trajs = _batch(backend.model, tiny_tokenizer)
    ids, attn, gpos, behav, mask = backend._tensors(trajs)
    with torch.no_grad():
        logp = backend.token_logprobs(ids, attn, gpos)
    assert torch.allclose(logp * mask, behav * mask, atol=1e-5)


def test_state_round_trip_resumes_identically(new_model, tiny_tokenizer):
    a = TorchBackend(new_model(), {"lr": 1e-3})
    trajs = _batch(a.model, tiny_tokenizer)
    a.step(trajs)
    b = TorchBackend(new_model(), {"lr": 1e-3})
    b.load_state(a.state_dict(), a.optimizer_state_dict())
    a.step(trajs)
    b.step(trajs)
    for k, v in a.state_dict().items():
        assert torch.allclose(v, b.state_dict()[k], atol=1e-6)


def test_minibatches_make_the_clip_active(new_model, tiny_tokenizer):
    backend = TorchBackend(new_model(), {"lr": 5e-3, "minibatches": 4, "clip_eps": 0.01})
    trajs = _batch(backend.model, tiny_tokenizer)
    m = backend.step(trajs)
    assert m["clip_frac"] > 0  # later minibatches see a policy that moved away from the proximal one


def _with_a_solved_group(trajs):
    """The batch plus a group whose samples all got reward 1: advantage 0, no learning signal."""
    import dataclasses

    solved = [dataclasses.replace(t, group_id="solved/policy", task_id="solved", reward=1.0,
                                  episode_id=f"solved/policy/{t.sample_index}") for t in trajs[:4]]
    return [*trajs, *solved]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_skipping_zero_advantage_rows_leaves_the_update_unchanged(new_model, tiny_tokenizer, minibatches):
    torch.manual_seed(0)
    full = TorchBackend(new_model(), {"lr": 5e-3, "minibatches": minibatches, "skip_zero_advantage": False})
    skip = TorchBackend(new_model(), {"lr": 5e-3, "minibatches": minibatches})
    trajs = _with_a_solved_group(_batch(full.model, tiny_tokenizer))
    solved_only = trajs[-4:]
    for batch in (trajs, trajs, solved_only, trajs):  # the third: nothing to learn, AdamW still steps
        m_full, m_skip = full.step(batch), skip.step(batch)
        assert m_skip["loss"] == pytest.approx(m_full["loss"], abs=1e-6)
        assert m_skip["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5, abs=1e-7)
    assert (m_full["trained_trajectories"], m_skip["trained_trajectories"]) == (12, 8)
    a, b = full.state_dict(), skip.state_dict()
    moved = TorchBackend(new_model()).state_dict()
    assert any(not torch.equal(a[k], moved[k]) for k in a)  # they trained
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


# -- the backend section ---------------------------------------------------------------------------
def test_build_backend_switches_on_type(tiny_model):
    from astraflow.trainer.simulated import SimulatedBackend

    torch_backend = build_backend(tiny_model, {"lr": 2e-3})  # no type: the built-in torch backend
    assert isinstance(torch_backend, TorchBackend) and torch_backend.config == TorchBackendConfig(lr=2e-3)
    assert isinstance(build_backend(tiny_model, None), TorchBackend)
    sim = build_backend(None, SimulatedBackendConfig(params=10))
    assert isinstance(sim, SimulatedBackend) and sim.state_dict()["simulated.weight"].numel() == 10
    with pytest.raises(ValueError, match="valid dictionary or instance of TorchBackendConfig"):
        TorchBackend(tiny_model, SimulatedBackendConfig())


@pytest.mark.parametrize(("section", "expected"), [
    ({"lr": 1e-3, "clip_eps_hi": 0.28}, "trainer backend 'torch': clip_eps_hi: Extra inputs are not permitted"),
    ({"lr": "fast"}, "trainer backend 'torch': lr: Input should be a valid number"),
    ({"type": "torch", "minibatches": 0}, "trainer backend 'torch': minibatches: Input should be greater than"),
    ({"type": "deepspeed"}, "unknown trainer backend 'deepspeed'; registered: ["),
    ({"type": "megatron", "lr_warmup": 10}, "trainer backend 'megatron': lr_warmup: Extra inputs are not permitted"),
    ({"type": "simulated", "lr": 1e-3}, "trainer backend 'simulated': lr: Extra inputs are not permitted"),
])
def test_a_backend_option_typo_is_refused_at_recipe_load(tmp_path, tiny_checkpoint, section, expected):
    from astraflow.recipe import Recipe

    data = yaml.safe_load(Path("examples/recipes/math.yaml").read_text())
    data["policies"][0].update(model=str(tiny_checkpoint), backend=section)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        Recipe.load(tmp_path / "r.yaml")
    assert f"policies.0.backend: {expected}" in str(err.value)


def test_a_recipe_without_backend_type_gets_torch_options():
    assert parse_backend({"lr": 5e-4}) == TorchBackendConfig(lr=5e-4)
    assert parse_backend("simulated") == SimulatedBackendConfig()


def test_validating_a_backend_section_imports_no_backend_runtime():
    code = ("import importlib.util, sys; from astraflow.trainer.config import parse_backend; "
            "parse_backend({'type': 'simulated'}); parse_backend({'lr': 1e-3}); "
            "parse_backend({'type': 'megatron'}) if importlib.util.find_spec('megatron') else None; "
            "print(sorted(m for m in ('torch', 'megatron', 'astraflow.trainer.simulated') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_on_cuda_equals_the_step_on_cpu(new_model, tiny_tokenizer):
    """The same batch and weights give the same loss, gradient norm and update on either device (fp32,
    TF32 off: torch's default for matmuls), and the published copies come back to the host."""
    cpu = TorchBackend(new_model(), {"lr": 1e-3})
    gpu = TorchBackend(new_model(), {"lr": 1e-3, "device": "cuda"})
    assert all(p.is_cuda for p in gpu.model.parameters())
    trajs = _batch(cpu.model, tiny_tokenizer)
    for _ in range(2):
        m_cpu, m_gpu = cpu.step(trajs), gpu.step(trajs)
        assert m_gpu["loss"] == pytest.approx(m_cpu["loss"], rel=1e-4, abs=1e-6)
        assert m_gpu["grad_norm"] == pytest.approx(m_cpu["grad_norm"], rel=1e-4)
    a, b = cpu.state_dict(), gpu.state_dict()
    assert all(t.device.type == "cpu" for t in b.values())
    start = new_model().state_dict()
    assert update_disagreement(start, a, b) < 1e-3  # 1.3e-4 on an H200
