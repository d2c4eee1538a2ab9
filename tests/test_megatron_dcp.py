"""connectors/megatron checkpoints through torch.distributed.checkpoint at any layout: a one-rank
checkpoint (weights and AdamW moments) resumes on a two-rank group (TP = 2, or DP = 2), and the
group's checkpoint resumes on one rank, with the trainer's own DCP writer
(``astraflow.trainer.sharded_checkpoint.write_local``: safetensors shards, no pickle) and DCP's
``HuggingFaceStorageReader`` resharding, as a resume does. The moments are checked by the next step:
a resumed backend whose moments were lost would take a different second step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from megatron_helpers import LR, MODELS, _batch, _free_port
from update_agreement import update_disagreement

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="needs megatron-core (`pip install 'astraflow[megatron]'`)")


def _load(backend, directory: Path, extras: dict, *, distributed: bool) -> None:
    """What ``sharded_checkpoint.restore`` does once the files are downloaded and checked."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = backend.sharded_state()
    dcp.load(state.tensors, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not distributed)
    state.extras = extras
    backend.load_sharded_state(state)


def _save(backend, group, out: Path, name: str) -> None:
    from astraflow.trainer.sharded_checkpoint import write_local

    local = write_local(backend.sharded_state(), group, name)
    out.mkdir(exist_ok=True)
    for f in local.directory.glob("*.safetensors"):
        shutil.copy(f, out / f"{local.rank}-{f.name}")
    shutil.rmtree(local.directory)
    if local.rank == 0:
        (out / "extras.json").write_text(json.dumps(local.extras))


def _worker(rank: int, world: int, port: int, make: str, options: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    from astraflow.trainer.distributed import current_group
    from connectors.megatron.backend import MegatronBackend

    group = current_group()
    group.start("cpu", timeout_s=120)
    model = MODELS[make]()
    trajs = _batch(model)
    backend = MegatronBackend(model, {"type": "megatron", "lr": LR, **options})
    one_rank = Path(out, "one-rank")
    _load(backend, one_rank, json.loads((one_rank / "extras.json").read_text()), distributed=True)
    states = {"resumed": backend.state_dict()}
    backend.step(trajs)
    states["second"] = backend.state_dict()
    _save(backend, group, Path(out, "group"), "group")
    backend.step(trajs)
    states["third"] = backend.state_dict()
    if rank == 0:
        for k, v in states.items():
            save_file(v, f"{out}/{k}.safetensors")
    group.close()


@pytest.mark.parametrize("make,options", [("qwen2", {"tensor_parallel": 2}), ("qwen2", {}),
                                          ("llama", {"pipeline_parallel": 2})], ids=["tp2", "dp2", "pp2"])
def test_a_checkpoint_resumes_on_another_layout_with_its_moments(tmp_path, make, options):
    import copy

    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from astraflow.trainer.distributed import SINGLE
    from connectors.megatron.backend import MegatronBackend

    model = MODELS[make]()
    trajs = _batch(model)
    one = MegatronBackend(copy.deepcopy(model), {"type": "megatron", "lr": LR})
    one.step(trajs)
    first = one.state_dict()
    _save(one, SINGLE, tmp_path / "one-rank", "one")
    one.step(trajs)
    second = one.state_dict()

    mp.spawn(_worker, args=(2, _free_port(), make, options, str(tmp_path)), nprocs=2, join=True)
    group = {k: load_file(tmp_path / f"{k}.safetensors") for k in ("resumed", "second", "third")}
    # 1 rank -> 2 ranks: the weights bit for bit, and the moments (the second step is the one rank's).
    assert all(torch.equal(group["resumed"][k], first[k]) for k in first)
    assert update_disagreement(first, second, group["second"]) < 1e-4
    lost_moments = MegatronBackend(copy.deepcopy(model), {"type": "megatron", "lr": LR})
    lost_moments.load_state(first, None)
    lost_moments.step(trajs)
    assert update_disagreement(first, second, lost_moments.state_dict()) > 0.1  # the check can fail

    # 2 ranks -> 1 rank: the same, from the group's checkpoint after its second step.
    back = MegatronBackend(copy.deepcopy(model), {"type": "megatron", "lr": LR})
    _load(back, tmp_path / "group", json.loads((tmp_path / "group" / "extras.json").read_text()), distributed=False)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in group["second"].items())
    back.step(trajs)
    assert update_disagreement(group["second"], group["third"], back.state_dict()) < 1e-4
