"""cp312 manylinux wheels of what the GPU machine lacks: a requirement closure walked over the wheels'
own METADATA (``pip download --no-deps`` per level, cached), stopping at what the machine has.

pip's own resolver is not used because it would follow every requirement down to torch and CUDA
wheels the machine already has; extras are not followed (the measured import lists need none).
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# The machine's Python and platform, for the requirement markers.
MACHINE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
               "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}

# On the machine (gpu-playbook.md: "What is on it"), with the requirements those packages bring and
# that the machine therefore has. PyYAML is a transformers requirement. Packages the playbook names
# as missing (pydantic, typing-extensions>=4.16, httpx2, ...) are NOT here, so they travel.
MACHINE_HAS = frozenset(canonicalize_name(n) for n in (
    "torch", "triton", "transformers", "pyarrow", "numpy", "safetensors", "tokenizers", "pytest",
    "pytest-timeout", "pytest-xdist", "hypothesis", "matplotlib", "rich", "accelerate", "filelock",
    "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "setuptools", "huggingface-hub",
    "hf-xet", "packaging", "pyyaml", "regex", "tqdm", "contourpy", "cycler", "fonttools", "kiwisolver",
    "pillow", "pyparsing", "python-dateutil", "six", "markdown-it-py", "mdurl", "pygments", "iniconfig",
    "pluggy", "execnet", "sortedcontainers", "psutil",
))


def machine_has(name: str) -> bool:
    n = canonicalize_name(name)
    return n in MACHINE_HAS or n.startswith(("nvidia-", "cuda-"))


def _platform_args() -> list[str]:
    plats = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
    args = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for p in plats:
        args += ["--platform", p]
    return args


def installed_versions(site_packages: list[Path]) -> dict[str, str]:
    """name -> version of the distributions in these site-packages folders (the venvs' pins)."""
    import importlib.metadata as md

    out: dict[str, str] = {}
    for dist in md.distributions(path=[str(p) for p in site_packages]):
        out.setdefault(canonicalize_name(dist.metadata["Name"]), dist.version)
    return out


def _cached(cache: Path, req: Requirement) -> Path | None:
    name = canonicalize_name(req.name)
    best = None
    for whl in cache.glob("*.whl"):
        wname, ver, _, _ = parse_wheel_filename(whl.name)
        matches = wname == name and req.specifier.contains(ver, prereleases=True)
        if matches and (best is None or ver > best[0]):
            best = (ver, whl)
    return best[1] if best else None


def _download(cache: Path, reqs: list[Requirement]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *_platform_args(), "-d", str(cache),
           *(str(r) for r in reqs)]
    print(f"  pip download {' '.join(str(r) for r in reqs)}", flush=True)
    subprocess.run(cmd, check=True)


def requires_of(whl: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the machine, extras not followed."""
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = z.read(meta).decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate(MACHINE_ENV):
            out.append(req)
    return out


def resolve(roots: list[Requirement], cache: Path, pins: dict[str, str],
            already: dict[str, Path] | None = None, follow: bool = True) -> dict[str, Path]:
    """name -> wheel for the closure of ``roots`` minus what the machine has and ``already`` holds
    (a previous group's wheels, so each name travels once). A pinned version (from the venvs here) is
    taken when it satisfies the requirement; otherwise the newest that does. ``follow=False``: the
    roots alone."""
    cache.mkdir(parents=True, exist_ok=True)
    already = dict(already or {})
    chosen: dict[str, Path] = {}
    level = [r for r in roots if not machine_has(r.name)]
    while level:
        wanted: dict[str, Requirement] = {}
        for r in level:
            name = canonicalize_name(r.name)
            if name in chosen or machine_has(name):
                continue
            if name in already:
                ver = parse_wheel_filename(already[name].name)[1]
                if not r.specifier.contains(ver, prereleases=True):
                    raise RuntimeError(f"{r} conflicts with {already[name].name} from an earlier group")
                continue
            pin = pins.get(name)
            spec = Requirement(f"{name}=={pin}") if pin and r.specifier.contains(Version(pin), True) \
                else Requirement(f"{name}{r.specifier}")
            wanted[name] = spec
        missing = [spec for spec in wanted.values() if _cached(cache, spec) is None]
        if missing:
            _download(cache, missing)
        nxt: list[Requirement] = []
        for name, spec in wanted.items():
            whl = _cached(cache, spec)
            if whl is None:
                raise RuntimeError(f"pip download gave no wheel for {spec}")
            chosen[name] = whl
            if follow:
                nxt += requires_of(whl)
        level = nxt
    return chosen
