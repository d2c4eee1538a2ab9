#!/usr/bin/env bash
# On the GPU machine, from the repo root: bash scripts/device/receive.sh .device/chunk-NN
# Checks the chunk against its manifest, stores it in $ASTRAFLOW_DEVICE_SCRATCH (default
# /root/astraflow-device; it persists while the machine stays warm), and once all of a group's parts
# are in, reassembles, unpacks and installs them and writes <scratch>/env.sh for gpu_checks.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "${PYTHON:-python3}" "$here/receive.py" "$@"
