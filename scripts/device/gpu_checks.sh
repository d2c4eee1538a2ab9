#!/usr/bin/env bash
# On the GPU machine, after receive.sh: bash scripts/device/gpu_checks.sh [--dry-run] PHASE...
#   weights      benchmarks/weight_sync.py --device cuda at 1.5B: step end -> serving, encoded on the GPU
#                (`one`) beside the weights copied to the host first (`host`)
#   rollout      preflight; benchmarks/gpu_rollout.py: the hf engine's eager and graphs paths, and vLLM
#                where the vllm group is installed, at 1 / 32 / 128 rows x 128 tokens; `pytest -k cuda`
#                on the built-in engine's, the torch backend's and the delta codec's test files
#   recipe-vllm  examples/recipes/smollm2_word_calc_vllm_cuda.yaml (trainer + vLLM on one GPU), capped
#   recipe       examples/recipes/smollm2_word_calc_cuda.yaml (the hf engine, decode: graphs), capped
#   heldout      greedy held-out accuracy of the checkpoint and of the last recipe run's last version
#   vllm         `import vllm`, then scripts/device/vllm_checks.sh compat engine
#   vllm-more    scripts/device/vllm_checks.sh e2e bench (its server and recipe steps: by hand)
# The recipes are stopped like Ctrl+C at $RECIPE_CAP_S (default 480 s), so they still write metrics.
# Each step runs under its own timeout with its log in $OUT/<step>.log, a failed step does not stop
# the next, and the last line printed is one JSON summary (also $OUT/summary-<phases>.json).
# --dry-run prints the steps instead of running them; --caps PHASE prints the longest the phase can
# take (s): its steps' caps plus the grace each gets between its stop signal and a kill.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
scratch=${ASTRAFLOW_DEVICE_SCRATCH:-/root/astraflow-device}
recipe_cap=${RECIPE_CAP_S:-480}
py=${PYTHON:-python3}

# name:cap(s) per phase, in the order they run: the most valuable measurement first. The caps are
# sized so that build_chunks.py's plan (scripts/device/plan_calls.py) fits one 15-minute lease.
steps_of() {
  case $1 in
    weights) echo "weight_sync:150" ;;
    rollout) echo "preflight:20 gpu_rollout:160 pytest_cuda:60" ;;
    recipe-vllm) echo "recipe_vllm:$recipe_cap" ;;
    recipe) echo "recipe:$recipe_cap" ;;
    heldout) echo "heldout_before:60 heldout_after:90" ;;
    # vllm_checks.sh's own step timeouts: compat 60 + engine 240; e2e 240 + bench 240.
    vllm) echo "vllm_import:90 vllm_checks:330" ;;
    vllm-more) echo "vllm_checks_more:510" ;;
    *) echo "unknown phase: $1 (weights, rollout, recipe-vllm, recipe, heldout, vllm, vllm-more)" >&2; return 1 ;;
  esac
}
# Seconds between a step's stop signal and its kill: a recipe stopped like Ctrl+C writes its metrics
# and report first.
grace_of() { case $1 in recipe*) echo 20 ;; *) echo 5 ;; esac; }
# The groups a phase needs installed.
groups_of() { case $1 in vllm*|recipe-vllm) echo "rollout vllm" ;; *) echo rollout ;; esac; }

if [ "${1:-}" = "--caps" ]; then
  total=0
  for s in $(steps_of "$2"); do total=$((total + ${s#*:} + $(grace_of "${s%%:*}"))); done
  echo "$total"; exit 0
fi
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
[ $# -gt 0 ] || { sed -n 2,10p "$0"; exit 2; }

out=${OUT:-$repo/.device/out}
mkdir -p "$out"
cd "$repo"
# shellcheck disable=SC1091
[ -f "$scratch/env.sh" ] && source "$scratch/env.sh"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$repo" PYTHONUNBUFFERED=1
export ASTRAFLOW_STATE_DIR=${ASTRAFLOW_STATE_DIR:-$scratch/state}

# The built-in engine's (eager and graphs), the trainer backend's and the codec's CUDA tests (the others,
# e.g. the static path's, FSDP2's and Megatron's, by hand: `pytest -k cuda $(grep -l cuda tests/test_*.py)`),
# to leave the session's minutes to the benchmark and the recipe.
cuda_test_files() { echo tests/test_engine_graphs.py tests/test_engine_hf.py tests/test_backend.py tests/test_delta_codec.py; }
have_group() { [[ " ${ASTRAFLOW_DEVICE_GROUPS:-} " = *" $1 "* ]]; }
# The graphs path first (the new figures), then the eager baseline, then vLLM where it is installed
# (last: it keeps its memory, and its start-up, with its own graphs captured, is the least known).
# Each path prints its JSON line as it ends, so a path cut by the cap loses only itself.
rollout_paths() { if have_group vllm; then echo graphs,eager,vllm; else echo graphs,eager; fi; }
# A recipe run's id: device-<recipe file's stem>-<time>, so that heldout finds the recipe of the last run.
recipe_cmd() {
  local f=examples/recipes/$1.yaml
  [ -f "$f" ] && echo "$py -m astraflow.cli.main run $f --runs-dir $scratch/runs --run-id device-$1-\$(date +%H%M%S) --no-live"
}
last_run() { ls -td "$scratch"/runs/device-* 2>/dev/null | head -1; }
# The last recipe run's last version exported from the bucket, then scored as heldout_before scores the
# checkpoint. `up` first (it only reports a stack that runs): the run stopped its own.
heldout_after_cmd() {
  local run stem
  run=$(basename "$(last_run)")
  if [ "$run" = . ] || [ -z "$run" ]; then [ $dry = 1 ] || return 0; run=device-RECIPE-HHMMSS; fi
  stem=${run#device-}; stem=${stem%-*}
  echo "$py -m astraflow.cli.main up >/dev/null && rm -rf $scratch/export && $py -m astraflow.cli.main weights export --run $run --policy policy --recipe examples/recipes/$stem.yaml $scratch/export && $py benchmarks/smollm2_task_baseline.py --device cuda --model $scratch/export --only word_calc_small_all --split heldout --samples 0 --prompts 100"
}

# The command of a step, or nothing when what it runs is not there yet ("missing").
command_of() {
  case $1 in
    # Every check runs (for the log); the step fails if any did.
    preflight) echo "f=0; nvidia-smi -L || f=1; $py -c 'import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0))' || f=1; $py -c 'import kafka, crc32c, zstandard, boto3, pydantic, yaml, bm25s, httpx2, gguf, astraflow, importlib.util as u; print(\"imports ok; vllm:\", u.find_spec(\"vllm\") and u.find_spec(\"vllm\").origin)' || f=1; \"\$ASTRAFLOW_WEED_BIN\" version || f=1; \"\$ASTRAFLOW_TANSU_BIN\" --help | head -3; echo ASTRAFLOW_DEVICE_GROUPS=\$ASTRAFLOW_DEVICE_GROUPS; exit \$f" ;;
    weight_sync) [ -f benchmarks/weight_sync.py ] && echo "$py benchmarks/weight_sync.py --device cuda --models 1.5b --modes one,host --versions 2" ;;
    gpu_rollout) [ -f benchmarks/gpu_rollout.py ] && echo "$py benchmarks/gpu_rollout.py --device cuda --rows 1,32,128 --tokens 128 --reps 1 --paths $(rollout_paths)" ;;
    pytest_cuda) echo "$py -m pytest -q -rs -p no:cacheprovider --continue-on-collection-errors -k cuda $(cuda_test_files)" ;;
    recipe_vllm) recipe_cmd smollm2_word_calc_vllm_cuda ;;
    recipe) recipe_cmd smollm2_word_calc_cuda ;;
    # Issue 26's held-out check: the same 200 held-out prompts, greedy, before and after RL.
    heldout_before) echo "$py benchmarks/smollm2_task_baseline.py --device cuda --only word_calc_small_all --split heldout --samples 0 --prompts 100" ;;
    heldout_after) heldout_after_cmd ;;
    vllm_import) echo "$py -c 'import vllm, torch; print(vllm.__version__, vllm.__file__, torch.cuda.is_available())'" ;;
    vllm_checks) [ -f scripts/device/vllm_checks.sh ] && echo "bash scripts/device/vllm_checks.sh compat engine" ;;
    vllm_checks_more) [ -f scripts/device/vllm_checks.sh ] && echo "bash scripts/device/vllm_checks.sh e2e bench" ;;
  esac
}

results=()
run_step() {  # name cap
  local name=$1 cap=$2 cmd rc status start secs sig=TERM
  cmd=$(command_of "$name")
  if [ -z "$cmd" ]; then
    echo "== $name: missing (not in this tree)"; results+=("$name missing - 0"); return
  fi
  if [ $dry = 1 ]; then
    echo "[dry-run] $name (cap ${cap}s, log \$OUT/$name.log): $cmd"; results+=("$name dry-run - 0"); return
  fi
  # A recipe is stopped like Ctrl+C, so that it still writes metrics.jsonl and report.png.
  [[ "$name" = recipe* ]] && sig=INT
  echo "== $name (cap ${cap}s)"; start=$(date +%s)
  timeout -s $sig -k "$(grace_of "$name")" "$cap" bash -c "$cmd" >"$out/$name.log" 2>&1; rc=$?
  secs=$(( $(date +%s) - start ))
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  # The tool brings back files of at most 16 MiB: keep a long log's end.
  if [ "$(stat -c %s "$out/$name.log")" -gt 15000000 ]; then
    tail -c 15000000 "$out/$name.log" >"$out/$name.log.t" && mv "$out/$name.log.t" "$out/$name.log"
  fi
  echo "   $status rc=$rc ${secs}s; last line: $(grep -v '^\s*$' "$out/$name.log" | tail -1 | cut -c1-300)"
  results+=("$name $status $rc $secs")
}

for phase in "$@"; do
  steps=$(steps_of "$phase") || exit 2
  missing_groups=""
  for g in $(groups_of "$phase"); do have_group "$g" || missing_groups+=" $g"; done
  if [ $dry = 0 ] && [ -n "$missing_groups" ]; then
    echo "== $phase: skipped, not installed:$missing_groups (receive.sh names the chunks to resend)"
    results+=("$phase not-installed - 0"); continue
  fi
  for s in $steps; do run_step "${s%%:*}" "${s#*:}"; done
  if [[ "$phase" = recipe* ]] && [ $dry = 0 ]; then
    run=$(last_run)
    for f in metrics.jsonl report.png; do [ -f "$run/$f" ] && cp "$run/$f" "$out/$phase-$f"; done
  fi
done

# One JSON line last: each step's status, rc, seconds and the last line of its log.
summary=$(printf '%s\n' "${results[@]}" | OUTDIR="$out" PHASES="$*" "$py" -c '
import json, os, sys
steps = []
for line in sys.stdin.read().split("\n"):
    if not line:
        continue
    name, status, rc, secs = line.split()
    log = os.path.join(os.environ["OUTDIR"], name + ".log")
    last = ""
    if status not in ("missing", "dry-run", "not-installed") and os.path.exists(log):
        lines = [l for l in open(log, errors="replace").read().splitlines() if l.strip()]
        last = lines[-1][:500] if lines else ""
    steps.append({"step": name, "status": status, "rc": None if rc == "-" else int(rc),
                  "seconds": int(secs), "last": last})
print(json.dumps({"phases": os.environ["PHASES"].split(), "build": os.environ.get("ASTRAFLOW_DEVICE_BUILD"),
                  "steps": steps}))
')
echo "$summary" >"$out/summary-$(echo "$*" | tr ' ' '-').json"
echo "$summary"
