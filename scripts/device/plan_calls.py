"""The sequence of `run` calls for a built manifest, and its worst case against one lease's budget.

One call per chunk (carry = that chunk); the `rollout` checks in the call whose chunk completes the
build (with vLLM in the build, its benchmark measures vLLM beside the built-in engine, so it waits for
vLLM's chunks); then the recipe as a call of its own: vLLM's recipe when vLLM is in the build, else
the hf engine's; then the held-out check where it fits. What does not fit is listed apart, to run
only if the lease has time left.

The worst case counts the machine's start, every transfer at its longest, every receive at its
longest, every step at its cap plus the grace before its kill (gpu_checks.sh --caps), a pause between
calls and the give-back. The recipe's cap is what is left of the budget (``recipe_cap_s=None``), so
caps are trimmed, never steps; a plan over the budget is refused (:class:`OverBudget`).
Timings are ESTIMATES from gpu-playbook.md and the rehearsal on the CPU machine, not measured for
these scripts on the GPU machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGET_S = 840          # of a lease's 900 s of device time: 60 s kept for what these numbers miss
START_S = 40            # the machine's start (gpu-playbook.md)
TRANSFER_S = (13, 25)   # a 50-60 MB transfer with a short command (gpu-playbook.md)
NO_CHUNK_TRANSFER_S = 10  # a call carrying only the ~3 MB working tree (a guess: not measured)
RECEIVE_S = 5           # receive.sh on a chunk that completes no group: copy + sha256 of <= 60 MB
INSTALL_S = 20          # ... on one that completes a group: also joins, unpacks, pip installs (rehearsal
                        # on 2 loaded cores: 8.8 s for vLLM's, 19.9 s for the rollout group's)
BETWEEN_CALLS_S = 5     # the session's turn between two calls, while the machine is held (a guess)
GIVE_BACK_S = 10        # closing the lease (a guess)
CALL_MARGIN_S = 60      # a call's timeout_s over its own worst case (a limit: it costs only if used)
MAX_TIMEOUT_S = 600
MAX_COMMAND = 2000
MIN_RECIPE_S = 150      # a recipe capped below this would stop during its start-up
HELDOUT_MIN_RECIPE_S = 300  # the held-out check joins the plan only if the recipe still gets this much


class OverBudget(Exception):
    """The plan's worst case is over the budget."""


def phase_s(phase: str, recipe_cap_s: int = 480) -> int:
    """The longest a gpu_checks.sh phase takes: its steps' caps and kill graces."""
    out = subprocess.run(["bash", str(HERE / "gpu_checks.sh"), "--caps", phase],
                         env={"PATH": "/usr/bin:/bin", "RECIPE_CAP_S": str(recipe_cap_s)},
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip())


def _call(carry: list[str], command: str, note: str, phases: tuple[str, ...], receive_s: int,
          recipe_cap_s: int) -> dict:
    if len(command) > MAX_COMMAND or len(carry) > 8:
        raise ValueError(f"call too long for the run tool: {command!r} carry={carry}")
    run_s = receive_s + sum(phase_s(p, recipe_cap_s) for p in phases)
    # Device time the call takes at worst: its transfer, the command, the pause before the next call.
    worst = (TRANSFER_S[1] if carry else NO_CHUNK_TRANSFER_S) + run_s + BETWEEN_CALLS_S
    return {"carry": carry, "command": command, "timeout_s": min(MAX_TIMEOUT_S, run_s + CALL_MARGIN_S),
            "worst_s": worst, "run_s": run_s, "note": note}


def _check(phases: tuple[str, ...], recipe_cap_s: int) -> str:
    env = f"RECIPE_CAP_S={recipe_cap_s} " if any(p.startswith("recipe") for p in phases) else ""
    return f"{env}bash scripts/device/gpu_checks.sh {' '.join(phases)}"


def _build(manifest: dict, rel_out: str, recipe_cap_s: int, heldout: bool) -> tuple[list[dict], list[dict]]:
    """(planned calls, calls for time left over) at this recipe cap."""
    groups = manifest["groups"]
    last = manifest["chunks"][-1]["name"]
    done = {g: max(p["chunk"] for i in manifest["items"] if i["group"] == g for p in i["parts"]) for g in groups}
    recipe = "recipe-vllm" if "vllm" in groups else "recipe"
    planned: list[dict] = []
    for chunk in manifest["chunks"]:
        name = chunk["name"]
        receive = f"bash scripts/device/receive.sh {rel_out}/{name}"
        installs = sum(1 for c in done.values() if c == name)
        receive_s = RECEIVE_S + INSTALL_S * installs
        size = f"{chunk['bytes'] / 1e6:.1f} MB"
        if name != last:
            planned.append(_call([f"{rel_out}/{name}"], receive, size, (), receive_s, recipe_cap_s))
        else:
            # the weight sync on CUDA where a lease has room for it beside the recipe (not beside vLLM's chunks)
            checks = ("rollout",) if "vllm" in groups else ("weights", "rollout")
            planned.append(_call([f"{rel_out}/{name}"], f"{receive} && {_check(checks, recipe_cap_s)}",
                                 f"{size}, then weight_sync.py on CUDA (1.5B) and the rollout checks: gpu_rollout.py "
                                 f"({'graphs, eager, vLLM' if 'vllm' in groups else 'graphs, eager'}), pytest -k cuda",
                                 checks, receive_s, recipe_cap_s))
    planned.append(_call([], _check((recipe,), recipe_cap_s), f"{recipe}: the real-model recipe, capped at {recipe_cap_s} s",
                         (recipe,), 0, recipe_cap_s))
    spare: list[dict] = []
    held = _call([], _check(("heldout",), recipe_cap_s), "held-out greedy accuracy before and after the recipe's RL",
                 ("heldout",), 0, recipe_cap_s)
    (planned if heldout else spare).append(held)
    if "vllm" in groups:
        spare.append(_call([], _check(("vllm",), recipe_cap_s), "vllm_checks.sh compat engine: the connector's tests on CUDA",
                           ("vllm",), 0, recipe_cap_s))
        spare.append(_call([], _check(("recipe",), recipe_cap_s), "the hf engine's recipe (decode: graphs), same cap",
                           ("recipe",), 0, recipe_cap_s))
    return planned, spare


def worst_case_s(planned: list[dict]) -> int:
    return START_S + sum(c["worst_s"] for c in planned) + GIVE_BACK_S


def calls(manifest: dict, rel_out: str, recipe_cap_s: int | None = None,
          budget_s: int = BUDGET_S) -> tuple[list[dict], list[dict], int]:
    """(planned calls, spare calls, the recipe's cap). ``recipe_cap_s=None``: what is left of the
    budget, in 10 s steps, with the held-out check planned only if the recipe still gets
    HELDOUT_MIN_RECIPE_S; a cap given: the held-out check planned if it fits. Raises OverBudget when the planned calls' worst case is over ``budget_s``,
    or when the recipe would get under MIN_RECIPE_S."""
    if recipe_cap_s is None:
        for heldout in (True, False):
            planned, _ = _build(manifest, rel_out, 0, heldout)
            cap = (budget_s - worst_case_s(planned)) // 10 * 10
            # A call runs at most MAX_TIMEOUT_S: the recipe's call too.
            cap = min(cap, MAX_TIMEOUT_S - CALL_MARGIN_S - phase_s("recipe", 0))
            if cap >= (HELDOUT_MIN_RECIPE_S if heldout else MIN_RECIPE_S):
                recipe_cap_s = cap
                break
        else:
            raise OverBudget(f"the recipe would get {cap} s (< {MIN_RECIPE_S} s) within the {budget_s} s budget: "
                             "fewer chunks (--vllm-strip max, or --with rollout) or shorter caps in gpu_checks.sh")
    else:
        heldout = worst_case_s(_build(manifest, rel_out, recipe_cap_s, True)[0]) <= budget_s
    planned, spare = _build(manifest, rel_out, recipe_cap_s, heldout)
    worst = worst_case_s(planned)
    if worst > budget_s:
        raise OverBudget(f"worst case {worst} s > the {budget_s} s budget (recipe capped at {recipe_cap_s} s): "
                         "lower --recipe-cap-s, or leave it out to fit it to the budget")
    return planned, spare, recipe_cap_s


def render(planned: list[dict], spare: list[dict], total_bytes: int, n_chunks: int, budget_s: int = BUDGET_S) -> str:
    lines = ["The `run` calls to make, in order, back to back (the machine keeps the scratch folder only while",
             "warm, ~30 s after a call), then give_back at once. 'by' = device time used by the end of that call",
             (f"in the worst case (start {START_S} s; each transfer {TRANSFER_S[1]} s; receive {RECEIVE_S} s, "
             f"+{INSTALL_S} s where it installs a group; every step at its cap + its kill grace; "
             f"{BETWEEN_CALLS_S} s between calls):"), ""]
    used = START_S
    for k, c in enumerate(planned, start=1):
        used += c["worst_s"]
        lines.append(f"{k}. run(carry={c['carry']}, timeout_s={c['timeout_s']},")
        lines.append(f"       command=\"{c['command']}\")")
        lines.append(f"   # {c['note']}; by {used} s")
    used += GIVE_BACK_S
    lines.append(f"{len(planned) + 1}. give_back()   # by {used} s")
    transfers = sum(1 for c in planned if c["carry"])
    lines += ["", (f"WORST CASE: {used} s of the {budget_s} s budget (a lease is 900 s). {total_bytes / 1e6:.1f} MB in "
              f"{n_chunks} chunks, {transfers} transfers ({START_S + transfers * TRANSFER_S[0]}-"
              f"{START_S + transfers * TRANSFER_S[1]} s with the start). ESTIMATES from gpu-playbook.md and the "
              "rehearsal, not measured for this build.")]
    if any("recipe-vllm" in c["command"] for c in planned):
        lines += ["", ("If the rollout call's gpu_rollout line for vllm shows an error (vLLM did not start), make the "
                  "recipe call with `gpu_checks.sh recipe` (the hf engine's recipe, same RECIPE_CAP_S) instead of "
                  "`recipe-vllm`.")]
    if spare:
        lines += ["", ("Only if time is left (not in the worst case): before give_back, if status's budget_left_s is over "
                  "the call's worst case + 60 s:")]
        for c in spare:
            lines.append(f"- run(carry=[], timeout_s={c['timeout_s']}, command=\"{c['command']}\")   "
                         f"# {c['note']}; worst {c['worst_s']} s")
    return "\n".join(lines)
