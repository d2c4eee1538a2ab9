"""Trainer checkpoints never unpickle bucket data: optimizer state is safetensors + JSON, a resume
takes the identical next step, and a pickle planted in the bucket is refused without running."""

from __future__ import annotations

import io
import os
import pickle

import pytest


def _model_and_adam(seed: int = 0, **adam):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, **adam)


def _step(model, opt, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 6, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def test_state_codec_round_trips_python_structure_exactly():
    import torch

    from astraflow.trainer.state_codec import decode_state, encode_state

    shared = torch.arange(4.0)
    state = {0: {"step": torch.tensor(3.0), "m": shared, "v": shared[:2]}, "groups": [{"betas": (0.9, 0.999),
             "lr": 1e-3, "foreach": None, "amsgrad": False, "params": [0, 1], "eps": float("inf")}], "steps": 7}
    got = decode_state(*encode_state(state))
    assert got[0]["step"].dim() == 0 and torch.equal(got[0]["m"], shared) and torch.equal(got[0]["v"], shared[:2])
    assert got["groups"] == state["groups"] and isinstance(got["groups"][0]["betas"], tuple)
    assert got["steps"] == 7 and list(got) == [0, "groups", "steps"]


def test_state_codec_refuses_what_it_cannot_store_or_did_not_write():
    from astraflow.trainer.state_codec import StateFormatError, decode_state, encode_state

    with pytest.raises(StateFormatError, match="object cannot be stored"):
        encode_state({"x": object()})
    tensors, skeleton = encode_state({"a": 1})
    with pytest.raises(StateFormatError, match="not JSON"):
        decode_state(tensors, pickle.dumps({"a": 1}))
    with pytest.raises(StateFormatError, match="not a safetensors"):
        decode_state(b"\x80\x04garbage", skeleton)
    with pytest.raises(StateFormatError, match="unexpected node"):
        decode_state(tensors, b'{"format":"astraflow-state/1","state":{"$tensor":"nope"}}')


def test_adam_state_resumes_to_the_identical_next_step(test_cluster):
    import torch

    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointStore, TrainerCheckpoint

    ckpts = CheckpointStore(ObjectStore.from_config(test_cluster), test_cluster.run, "policy")
    model, opt = _model_and_adam(amsgrad=True)
    for s in range(3):
        _step(model, opt, s)
    pointer = ckpts.save(TrainerCheckpoint(step=3, version=3, model_state=model.state_dict(),
                                           optimizer_state=opt.state_dict()))
    assert set(pointer["parts"]) == {"model", "optimizer_tensors", "optimizer_structure"}
    assert not any(info["key"].endswith(".pt") for info in pointer["parts"].values())

    got = ckpts.load()
    model2, opt2 = _model_and_adam(seed=99, amsgrad=True)  # different init: everything must come from the checkpoint
    model2.load_state_dict(got.model_state)
    opt2.load_state_dict(got.optimizer_state)
    _step(model, opt, 3)
    _step(model2, opt2, 3)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for k, sa in opt.state_dict()["state"].items():
        sb = opt2.state_dict()["state"][k]
        assert all(torch.equal(sa[n], sb[n]) for n in sa)


class _Payload:
    """A pickle that creates a file when unpickled: what an attacker with bucket write access plants."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _pickle_bytes(path) -> bytes:
    buf = io.BytesIO()
    pickle.dump({"state": {}, "param_groups": [], "x": _Payload(str(path))}, buf)
    return buf.getvalue()


def test_pickled_optimizer_state_is_refused_without_running(test_cluster, tmp_path):
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointError, CheckpointStore, TrainerCheckpoint

    pwned = tmp_path / "pwned"
    # the payload works: unpickled, it creates the file (so its absence below means it did not run)
    pickle.loads(_pickle_bytes(tmp_path / "proof"))
    assert (tmp_path / "proof").exists()

    store = ObjectStore.from_config(test_cluster)
    ckpts = CheckpointStore(store, test_cluster.run, "policy")
    model, opt = _model_and_adam()
    _step(model, opt, 0)
    pointer = ckpts.save(TrainerCheckpoint(step=1, version=1, model_state=model.state_dict(),
                                           optimizer_state=opt.state_dict()))
    evil = _pickle_bytes(pwned)

    # 1. an old (format-1) checkpoint whose optimizer part is a torch.save pickle
    pt_key = pointer["parts"]["model"]["key"].replace("model.safetensors", "optimizer.pt")
    old = {**pointer, "format": 1, "parts": {"model": pointer["parts"]["model"],
                                             "optimizer": {"key": pt_key, "sha256": store.put_bytes(pt_key, evil),
                                                           "bytes": len(evil)}}}
    store.put_json(ckpts._key("latest.json"), old)
    with pytest.raises(CheckpointError, match=f"{pt_key} is a pickle"):
        ckpts.load()

    # 2. the pickle written in place of the optimizer tensors / structure of a current checkpoint
    for part in ("optimizer_tensors", "optimizer_structure"):
        info = pointer["parts"][part]
        original = store.get_bytes(info["key"])
        forged = {**pointer, "parts": {**pointer["parts"], part: {**info, "sha256": store.put_bytes(info["key"], evil)}}}
        store.put_json(ckpts._key("latest.json"), forged)
        with pytest.raises(CheckpointError, match=f"{info['key']}.*refused"):
            ckpts.load()
        store.put_bytes(info["key"], original)
        store.put_json(ckpts._key("latest.json"), pointer)

    # 3. a pickle as the model weights
    info = pointer["parts"]["model"]
    store.put_json(ckpts._key("latest.json"), {**pointer, "parts": {**pointer["parts"], "model": {
        **info, "sha256": store.put_bytes(info["key"], evil)}}})
    with pytest.raises(CheckpointError, match=f"{info['key']} is not a safetensors file"):
        ckpts.load()
    assert not pwned.exists()


def test_no_pickle_loads_in_the_package():
    """Guard: bucket data is read by safetensors/JSON/Arrow only."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent / "astraflow"
    unsafe = re.compile(r"torch\.load\(|pickle\.loads?\(|weights_only\s*=\s*False|allow_pickle\s*=\s*True")
    hits = [f"{p}:{n}" for p in root.rglob("*.py") for n, line in enumerate(p.read_text().splitlines(), 1)
            if unsafe.search(line)]
    assert hits == []
