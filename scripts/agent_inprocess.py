#!/usr/bin/env python
"""Dev harness for the tool-using agent recipe (``examples/recipes/calc_agent.yaml``): tool-use SFT
warm start, greedy held-out evaluation (accuracy + valid-call rate), GRPO, evaluation again — all in
one process (no Kafka, no S3), through ``scripts/rl_inprocess.py``'s loop.

    nice -n 10 .venv/bin/python scripts/agent_inprocess.py examples/recipes/calc_agent.yaml --set trainer.steps=40

Until ``ToolAgentWorkflow.warm_start_examples`` calls :func:`astraflow.workflows.tool_sft.tool_use_examples`,
this harness installs that override itself.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _install_tool_sft() -> None:
    from astraflow.workflows import tool_agent, tool_sft

    cls = tool_agent.ToolAgentWorkflow
    if "tool_sft" in (cls.warm_start_examples.__code__.co_names + cls.warm_start_examples.__code__.co_consts):
        return

    def warm_start_examples(self, policy, problems, tokenizer, seed=0):
        return tool_sft.tool_use_examples(self, problems, tokenizer, seed)

    cls.warm_start_examples = warm_start_examples


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE.parent))
    import astraflow.tools  # noqa: F401  (registers the calculator tool)

    _install_tool_sft()
    spec = importlib.util.spec_from_file_location("rl_inprocess", HERE / "rl_inprocess.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


if __name__ == "__main__":
    sys.exit(main())
