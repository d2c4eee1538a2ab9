#!/usr/bin/env bash
# On the GPU machine, from the repo root: bash scripts/device/receive.sh .device/chunk-NN
# Checks the chunk against its manifest, stores it in $ASTRAFLOW_DEVICE_SCRATCH (default
# /root/astraflow-device; it persists while the machine stays warm), and once all of a group's parts
# are in, reassembles, unpacks and installs them and writes <scratch>/env.sh for gpu_checks.sh.
# A missing or renamed chunk folder: exit 3, naming the folder it expects; a corrupted one: exit 2.
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: bash scripts/device/receive.sh .device/chunk-NN: the chunk folder carried in this call, under the" \
       "name build_chunks.py gave it (carry=['.device/chunk-01'] -> receive.sh .device/chunk-01)" >&2
  exit 3
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "${PYTHON:-python3}" "$here/receive.py" "$@"
