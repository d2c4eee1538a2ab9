"""vLLM's wheel without its optional CUDA extensions (gpu-playbook.md, "vLLM there"), repacked as a
wheel pip still installs: ``zip -d`` deletes entries without recompressing the rest, and RECORD loses
their lines. ``_C_stable_libtorch`` (the core ops) always stays."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

# 129.5 MB FlashAttention-2 build, 15.6 MB Rust front end, 10.5 MB Blackwell / DeepGEMM sources.
DROP_MOE = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/vllm_rs*",
            "vllm/third_party/fmha_sm100/*", "vllm/third_party/deep_gemm/*")
# Also the fused-MoE ops (40.9 MB): MoE models will not run; dense ones do not touch them (0.26 imports
# them under contextlib.suppress(ImportError): platforms/cuda.py import_kernels), and FlashAttention-3,
# Hopper's attention backend, stays. One chunk fewer for --with rollout,vllm.
DROP_DENSE = DROP_MOE + ("vllm/_moe_C*",)
# Also FlashAttention-3 (38.4 MB): attention should fall back to Triton (not yet seen on a GPU).
DROP_MAX = DROP_DENSE + ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",)
KEEP = ("vllm/_C_stable_libtorch.abi3.so",)
LEVELS = {"moe": DROP_MOE, "dense": DROP_DENSE, "max": DROP_MAX}


def dropped(names: list[str], level: str) -> list[str]:
    patterns = LEVELS[level]
    out = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
    kept_core = [k for k in KEEP if k in out]
    if kept_core:
        raise RuntimeError(f"strip level {level!r} would drop {kept_core}, which vLLM needs")
    return out


def strip(src: Path, dst: Path, level: str) -> list[str]:
    """Write the stripped wheel to ``dst`` (same file name as ``src``: pip reads the tags from it)."""
    with zipfile.ZipFile(src) as z:
        names = z.namelist()
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        record = z.read(record_name).decode()
    drop = dropped(names, level)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    # zip -d reads names as wildcards; '[' is the only one that could occur in these paths.
    subprocess.run(["zip", "-q", "-d", str(tmp), *drop], check=True)
    gone = set(drop)
    kept = "".join(line + "\n" for line in record.splitlines() if line.split(",", 1)[0] not in gone)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / record_name).parent.mkdir(parents=True)
        (Path(d) / record_name).write_text(kept)
        subprocess.run(["zip", "-q", "-X", str(tmp.resolve()), record_name], cwd=d, check=True)
    with zipfile.ZipFile(tmp) as z:
        left = set(z.namelist())
    if left & gone or not set(KEEP) <= left:
        raise RuntimeError(f"stripping {src.name} went wrong: dropped entries still in, or core missing")
    tmp.replace(dst)
    return drop
