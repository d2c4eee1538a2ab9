"""Does a secured run learn as the plaintext one does? The math recipe twice, side by side in one run:

* **secured**: a secured embedded stack (``astraflow up --secure``), the launcher with no node of its own
  and one node started from another state dir with the file ``astraflow credentials issue node`` wrote,
  through the TLS listeners (as ``tests/test_security_run.py``, at full length);
* **plaintext**: ``astraflow run`` on a plaintext embedded stack of its own, with the recipe's one node.

Both on the in-memory log, every component (the remote node too) with ``--threads`` torch threads. Reports each run's wall time and the trainer's mean batch reward over its
first and last ``--window`` steps. Prints ONE JSON line last.

    python benchmarks/secure_run.py [--recipe examples/recipes/math.yaml] [--steps 60] [--window 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

CLI = [sys.executable, "-m", "astraflow.cli.main"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}


def _rewards(run_dir: Path) -> list[float]:
    from astraflow.records.control import TrainerStep
    from astraflow.report.plot import typed_records

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in typed_records([json.loads(x) for x in lines if x.endswith("}")]) if isinstance(r, TrainerStep)]
    return [r.reward_mean for r in sorted(steps, key=lambda r: r.step)]


def _summary(run_dir: Path, seconds: float, window: int) -> dict:
    rewards = _rewards(run_dir)
    return {"steps": len(rewards), "seconds": round(seconds, 1),
            "reward_first": round(statistics.fmean(rewards[:window]), 3),
            "reward_last": round(statistics.fmean(rewards[-window:]), 3)}


def _secured(tmp: Path, recipe: Path, steps: int, window: int, threads: int) -> dict:
    from astraflow.config import EMBEDDED_FETCH_MAX_WAIT_MS
    from astraflow.embedded import EmbeddedStack
    from astraflow.security.material import SecureMaterial, write_private

    stack, _ = EmbeddedStack.start_private(tmp / "secure-state", storage="memory", secure=True)
    try:
        remote = tmp / "remote"
        remote.mkdir()
        issued = SecureMaterial(stack.state_dir).credential_file("node", stack.kafka_bootstrap, stack.s3_endpoint,
                                                                 "astraflow", EMBEDDED_FETCH_MAX_WAIT_MS["memory"])
        write_private(remote / "node.yaml", yaml.safe_dump(issued))
        t0 = time.monotonic()
        launcher = subprocess.Popen([*CLI, "run", str(recipe), "--run-id", "secured", "--runs-dir", str(tmp / "runs"),
                                     "--no-live", "--steps", str(steps), "--state-dir", str(stack.state_dir),
                                     "--nodes", "default=0", "--threads", str(threads)], env=_env(), cwd=tmp,
                                    stdout=(tmp / "secured.out").open("w"), stderr=subprocess.STDOUT)
        node = subprocess.Popen([*CLI, "node", "--cluster", "node.yaml", "--recipe", str(recipe), "--run-id", "secured",
                                 "--pool", "default", "--node-id", "remote-1", "--threads", str(threads)],
                                env=_env(), cwd=remote,
                                stdout=(remote / "node.out").open("w"), stderr=subprocess.STDOUT)
        try:
            if launcher.wait(timeout=1800) != 0:
                raise SystemExit(f"secured run failed:\n{(tmp / 'secured.out').read_text()[-3000:]}")
            seconds = time.monotonic() - t0
        finally:
            for proc in (node, launcher):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=60)
        return _summary(tmp / "runs" / "secured", seconds, window)
    finally:
        stack.down()


def _plaintext(tmp: Path, recipe: Path, steps: int, window: int, threads: int) -> dict:
    t0 = time.monotonic()
    out = subprocess.run([*CLI, "run", str(recipe), "--run-id", "plaintext", "--runs-dir", str(tmp / "runs"),
                          "--no-live", "--steps", str(steps), "--state-dir", str(tmp / "plain-state"),
                          "--log-storage", "memory", "--threads", str(threads)], env=_env(), cwd=tmp, capture_output=True, text=True,
                         timeout=1800, check=False)
    if out.returncode != 0:
        raise SystemExit(f"plaintext run failed:\n{out.stdout[-3000:]}{out.stderr[-2000:]}")
    return _summary(tmp / "runs" / "plaintext", time.monotonic() - t0, window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=Path(__file__).parent.parent / "examples/recipes/math.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of every component, the remote node's too (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="secure-run-") as tmp:
        secured = _secured(Path(tmp), args.recipe.absolute(), args.steps, args.window, args.threads)
        print(json.dumps({"secured": secured}), flush=True)
        plaintext = _plaintext(Path(tmp), args.recipe.absolute(), args.steps, args.window, args.threads)
    print(json.dumps({"benchmark": "secure_run", "recipe": args.recipe.name, "steps": args.steps, "threads": args.threads,
                      "window": args.window, "secured_remote_node": secured, "plaintext": plaintext}))


if __name__ == "__main__":
    main()
