#!/usr/bin/env python
"""Dead code (``make lint``): no function, method, class or property without a caller outside the tests.

    python scripts/dead_code.py

Runs vulture over the code that may call AstraFlow (the package, the connectors, the benchmarks and
the scripts; not the tests, so code only the tests call is reported too) and reports:

* every unused function, method, class and property (vulture gives these 60 % confidence: it cannot
  see a call by name, so the few such calls are listed in ``scripts/vulture_whitelist.py``, each
  with why);
* everything vulture is at least 90 % sure of: unused imports and arguments, unreachable code.

Unused attributes and variables below 90 % are not reported: most are read where vulture cannot see
(pydantic fields written to JSON, settings on a tokenizer or a Megatron module). Decorators that
register (plug-ins, datasets, engines, backends) or validate (pydantic) are calls too.
Exit status 1 when anything is reported.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vulture import Vulture

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["astraflow", "connectors", "benchmarks", "scripts"]
WHITELIST = "scripts/vulture_whitelist.py"
CALLABLE_KINDS = {"function", "method", "class", "property"}
CERTAIN = 90
IGNORE_DECORATORS = ["@register_*", "@model_validator", "@field_validator"]


def main() -> int:
    vulture = Vulture(ignore_decorators=IGNORE_DECORATORS)
    vulture.scavenge([str(ROOT / p) for p in PATHS])
    found = [item for item in vulture.get_unused_code(min_confidence=60)
             if item.typ in CALLABLE_KINDS or item.confidence >= CERTAIN]
    for item in found:
        print(item.get_report(add_size=False).replace(f"{ROOT}/", ""))
    print(f"dead code: {len(found)} finding(s) in {', '.join(PATHS)} (whitelist: {WHITELIST})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
