"""Seconds from Ctrl+C (SIGINT) to ``astraflow run`` returning, while its node drains long episodes.

The simulated recipe (``examples/recipes/sim_single.yaml``) with a slow decode (10 tokens/s per
sequence, ~300-token responses): when the signal comes, the node holds ~40 episodes of ~30 s each, and
its drain (the pool's ``drain_timeout_s``, 30 s) would hold the stop. The run owns an embedded stack in
a temporary state dir. ``--baseline-tree DIR`` measures another checkout (e.g. a worktree of the commit
before) the same way in the same run, through its own ``astraflow`` package on ``PYTHONPATH``.

    python benchmarks/ctrl_c_exit.py [--baseline-tree ../main-before] [--repeats 1]

Last line: one JSON object, ``{"exit_s": [...], "baseline_exit_s": [...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def measure(tree: Path, tmp: Path) -> float:
    """One run from ``tree``: SIGINT 5 s after the first node status, seconds until the launcher exits."""
    data = yaml.safe_load((ROOT / "examples" / "recipes" / "sim_single.yaml").read_text())
    data["policies"][0]["model"] = str(ROOT / "examples" / "models" / "tiny.yaml")
    data["pools"][0]["engine"].update(tokens_per_s=10, median_tokens=300, sigma=0.3)
    data["trainer"]["steps"] = 50
    recipe = tmp / "sim.yaml"
    recipe.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env.update(ASTRAFLOW_STATE_DIR=str(tmp / "state"), PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(recipe), "--run-id", "ctrl-c",
           "--runs-dir", str(tmp / "runs"), "--no-live"]
    metrics = tmp / "runs" / "ctrl-c" / "metrics.jsonl"
    with open(tmp / "launcher.out", "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
        deadline = time.monotonic() + 180
        while not (metrics.exists() and '"raas"' in metrics.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"no node status from {tree}: {(tmp / 'launcher.out').read_text()[-2000:]}")
            time.sleep(0.2)
        time.sleep(5.0)  # the node's episodes under way
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    if rc != 130:
        raise RuntimeError(f"exit status {rc} from {tree}: {(tmp / 'launcher.out').read_text()[-2000:]}")
    return round(time.monotonic() - t0, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path, help="another checkout to measure the same way")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    result: dict = {"benchmark": "ctrl_c_exit", "exit_s": [], "baseline_exit_s": [],
                    "load_avg_1m_at_start": os.getloadavg()[0]}
    for _ in range(args.repeats):
        trees = [("exit_s", ROOT)] + ([("baseline_exit_s", args.baseline_tree.resolve())] if args.baseline_tree else [])
        for key, tree in trees:
            with tempfile.TemporaryDirectory(prefix="ctrl-c-") as tmp:
                result[key].append(measure(tree, Path(tmp)))
                print(f"{key} {tree}: {result[key][-1]} s", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
