"""The sequence of `run` calls for a built manifest: one per chunk (carry = that chunk), the check
phases appended to the call whose chunk completes their group, and the recipe as a call of its own.

Timings are ESTIMATES from gpu-playbook.md (machine start ~40 s; a 50-60 MB transfer 13-25 s); a
phase's time is bounded by its steps' caps in gpu_checks.sh, which is asked for them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
START_S = 40
TRANSFER_S = (13, 25)
RECEIVE_S = 60          # timeout margin for receive.sh (copy + sha256, reassembly, pip install)
RECEIVE_EST_S = 15      # its time in the budget: 0.2-10 s per chunk in the rehearsal on the CPU machine
NO_CHUNK_TRANSFER_S = 10  # a call carrying only the ~3 MB working tree (a guess: not measured)
MAX_TIMEOUT_S = 600
MAX_COMMAND = 2000
BUDGET_S = 15 * 60
# Calls that need no further transfer, right after a group's checks: the recipe uses the rollout
# group; vllm_checks.sh's longer steps do not fit in the first vLLM call's 600 s.
FOLLOW_UPS = {"rollout": ("recipe", "heldout"), "vllm": ("vllm-more",)}
# The groups a phase needs installed: vllm_checks.sh's engine / e2e steps use the stack, the model and
# AstraFlow's wheels too.
NEEDS = {"rollout": ("rollout",), "vllm": ("rollout", "vllm")}


def phase_cap(phase: str, recipe_cap_s: int) -> int:
    out = subprocess.run(["bash", str(HERE / "gpu_checks.sh"), "--caps", phase],
                         env={"PATH": "/usr/bin:/bin", "RECIPE_CAP_S": str(recipe_cap_s)},
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip())


def calls(manifest: dict, rel_out: str, recipe_cap_s: int = 480) -> list[dict]:
    last_chunk = {g: max(p["chunk"] for i in manifest["items"] if i["group"] == g for p in i["parts"])
                  for g in manifest["groups"]}
    due = {g: max(last_chunk[n] for n in NEEDS[g]) for g in manifest["groups"]}
    phases_after = {c: [g for g in manifest["groups"] if due[g] == c] for c in due.values()}
    env = f"RECIPE_CAP_S={recipe_cap_s} " if recipe_cap_s != 480 else ""
    out: list[dict] = []

    def add(carry: list[str], command: str, receive: bool, phase: str | None, note: str) -> None:
        if len(command) > MAX_COMMAND or len(carry) > 8:
            raise ValueError(f"call too long for the run tool: {command!r} carry={carry}")
        cap = phase_cap(phase, recipe_cap_s) if phase else 0
        run_s = (RECEIVE_S if receive else 0) + cap
        # Upper bound of the device time the call takes: its transfer, receive's margin, the caps.
        worst = (TRANSFER_S[1] if carry else NO_CHUNK_TRANSFER_S) + (RECEIVE_EST_S if receive else 0) + cap
        out.append({"carry": carry, "command": command, "timeout_s": min(MAX_TIMEOUT_S, run_s + 60),
                    "worst_s": worst, "note": note})

    for chunk in manifest["chunks"]:
        name = chunk["name"]
        receive = f"bash scripts/device/receive.sh {rel_out}/{name}"
        size = f"{chunk['bytes'] / 1e6:.1f} MB"
        done = phases_after.get(name, [])
        if not done:
            add([f"{rel_out}/{name}"], receive, True, None, size)
            continue
        for k, phase in enumerate(done):
            if k == 0:
                add([f"{rel_out}/{name}"], f"{receive} && {env}bash scripts/device/gpu_checks.sh {phase}", True,
                    phase, f"{size}, then the {phase} checks")
            else:
                add([], f"{env}bash scripts/device/gpu_checks.sh {phase}", False, phase, f"the {phase} checks")
            for more in FOLLOW_UPS[phase]:
                note = {"recipe": f"the real-model recipe (capped at {recipe_cap_s} s)",
                        "heldout": "held-out greedy accuracy before and after the recipe's RL"}.get(more, f"the {more} checks")
                add([], f"{env}bash scripts/device/gpu_checks.sh {more}", False, more, note)
    return out


def render(plan: list[dict], total_bytes: int, n_chunks: int) -> str:
    lines = ["The `run` calls to make, in order (back to back: the machine keeps the scratch folder only",
             "while warm, ~30 s after a call; give_back at the end). 'by' = device time used by the end",
             "of that call in the worst case (machine start, every transfer at 25 s, receive 15 s, every step",
             "at its cap):", ""]
    used = START_S
    for k, c in enumerate(plan, start=1):
        used += c["worst_s"]
        flag = "  <- past the 15-minute budget" if used > BUDGET_S else ""
        lines.append(f"{k}. run(carry={c['carry']}, timeout_s={c['timeout_s']},")
        lines.append(f"       command=\"{c['command']}\")")
        lines.append(f"   # {c['note']}; by {used} s{flag}")
    transfers = sum(1 for c in plan if c["carry"])
    lines += ["", (f"{total_bytes / 1e6:.1f} MB in {n_chunks} chunks, {transfers} transfers. ESTIMATE from "
              f"gpu-playbook.md (not measured for this build): start ~{START_S} s, {TRANSFER_S[0]}-"
              f"{TRANSFER_S[1]} s per 50-60 MB transfer: {START_S + transfers * TRANSFER_S[0]}-"
              f"{START_S + transfers * TRANSFER_S[1]} s of transfers; the checks add up to their caps "
              f"(worst case in all: {used} s; budget {BUDGET_S} s).")]
    if used > BUDGET_S:
        lines.append("The worst case is over the budget. Steps usually end before their caps; if time runs "
                     "short, skip the calls that carry nothing (the recipe, vllm-more: no later call needs them) or "
                     "stop after the last one within it, or rebuild with "
                     "--recipe-cap-s 300, --vllm-strip max, or without vllm.")
    return "\n".join(lines)
