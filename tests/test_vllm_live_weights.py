"""The in-place patch path of the vLLM engine (connectors/vllm/live_weights.py) on the CPU line.

vLLM-CPU normally packs its linear weights at load, so the engine refuses patches there
(test_vllm_engine.py checks that refusal). vLLM also has a fallback that computes with
``torch.nn.functional.linear`` from the parameters as they are (taken when neither oneDNN nor its
sgl-kernel applies); forcing vLLM onto it gives a real vLLM model that computes from its own
parameters, as on CUDA. On it this test checks what the GPU relies on: every published name maps
onto the right rows of vLLM's fused tensors (equal to the HF model's, bit for bit), a sparse delta
written through those views lands (CRC-verified) and vLLM then decodes as the HF model with the new
weights, and a full reload rebuilds the views.

The forcing is two settings of vLLM's dispatch (its oneDNN and sgl-kernel checks answer no), and
telling the connector that no layer is packed (``packed_layers``: with the fallback every layer still
has a ``cpu_linear``, which is how the connector detects packing). It runs in a Python of its own: an
in-process vLLM engine per process, and the dispatch settings must not reach the other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these in .venv-vllm")


def test_a_patch_written_through_the_published_names_lands_in_vllms_tensors():
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1], check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["patched_tensors"] > 0 and report["views"] > report["fused_parameters"]
    print(report)


def _copies(state: dict) -> dict:
    """CPU copies of ``state``'s tensors, one per storage (a tied LM head stays the embedding's tensor)."""
    seen: dict = {}
    return {k: seen.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)),
                                v.detach().cpu().clone()) for k, v in state.items()}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import vllm._custom_ops
    import vllm.model_executor.layers.utils as vllm_layer_utils
    from engine_agreement import LOGPROB_TOL, max_diff

    from astraflow.delta.codec import encode
    from astraflow.delta.patch import one_part, prepare_patch
    from astraflow.engines import FullState, InPlacePatch, SamplingParams, build_engine
    from astraflow.engines.hf import HFEngine
    from astraflow.models.checkpoint import load_model, resolve_checkpoint
    from connectors.vllm import live_weights

    vllm._custom_ops._supports_onednn = False
    vllm_layer_utils.check_cpu_sgl_kernel = lambda n, k, dtype: False
    live_weights.packed_layers = lambda model: []

    # the tiny Qwen2 model: fused qkv with biases, gate_up, a tied LM head
    tiny = resolve_checkpoint(str(Path("examples/models/tiny.yaml").resolve()))
    model = load_model(tiny)
    engine = build_engine({"type": "vllm", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 4}, model)
    hf = HFEngine(load_model(tiny))
    assert InPlacePatch in engine.accepted_updates, engine.patch_refusal
    live, ref = engine.state_dict(), hf.model.state_dict()
    assert live.keys() == ref.keys(), sorted(set(live) ^ set(ref))
    wrong = [k for k in ref if not torch.equal(live[k], ref[k])]
    assert not wrong, f"published names mapped to other rows of vLLM's tensors: {wrong}"
    fused = {k.rsplit(".", 2)[0] for k in live if ".q_proj." in k or ".gate_proj." in k}

    old, v = _copies(live), engine.weight_version
    new = dict(old)
    g = torch.Generator().manual_seed(3)
    changed = ["model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.k_proj.bias",
               "model.layers.1.mlp.gate_proj.weight", "model.embed_tokens.weight"]
    for name in changed:
        t = old[name].clone()
        flat = t.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 20)]] += 2.0 * float(t.std())
        new.update({k: t for k, x in old.items() if x is old[name]})  # both names of a tied tensor
    patch = prepare_patch(live, [one_part(v + 1, encode(old, new, base_version=v, target_version=v + 1))], v)
    prompts = [[1, 5, 9, 14, 20], [2, 7, 7, 3]]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=())
    before = engine.generate(prompts, greedy)
    engine.update_weights(InPlacePatch(patch.write, v + 1))
    assert patch.verify(live) == [], "vLLM's tensors do not hold the target's bits"
    hf.update_weights(FullState(new, v + 1))
    after, expected = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
    for a, h in zip(after, expected, strict=True):
        assert a.token_ids == h.token_ids and a.versions == [v + 1] * 8, (a, h)
        assert max_diff(a.logprobs, h.logprobs) < LOGPROB_TOL, (a.logprobs, h.logprobs)
    moved = max(max_diff(b.logprobs, a.logprobs) for b, a in zip(before, after, strict=True))
    assert moved > 10 * LOGPROB_TOL, f"the patch did not move vLLM's outputs ({moved})"

    # a full reload may re-create vLLM's parameters: the views are rebuilt and hold the loaded state
    engine.update_weights(FullState(dict(old), v + 2))
    reloaded = engine.state_dict()
    assert all(torch.equal(reloaded[k], old[k]) for k in old)
    print(json.dumps({"views": len(live), "fused_parameters": len(fused), "patched_tensors": len(patch.changed),
                      "max_logprob_diff_vs_hf": max(max_diff(a.logprobs, h.logprobs) for a, h in zip(
                          after, expected, strict=True)), "logprob_move_by_patch": moved}))


if __name__ == "__main__":
    main()
