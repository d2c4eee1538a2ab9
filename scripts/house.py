#!/usr/bin/env python
"""Measure the house: rooms, floors, circles and imports that climb back up.

    python scripts/house.py            # figures, then one JSON line last
    python scripts/house.py --check    # the same, exit 1 when a circle or a climbing import exists
    python scripts/house.py --lazy     # also list every lazy import across rooms

Rooms are the packages (directories with ``__init__.py``) under ``astraflow/`` and ``connectors/``. The
root package ``astraflow`` holds no code of its own, only loose single-purpose modules at very different
heights (``registry`` at the bottom, ``demo`` at the top), so each of its modules is a room of its own
(``astraflow.registry``, ``astraflow.sft``, ...).

An import is an edge from the importing module's room to the imported module's room (the deepest room
holding the target; ``from pkg import name`` resolves to ``pkg.name`` when that is a module). Kinds:

* top-level: executed when the module is imported (``try:`` and ``if`` blocks included);
* lazy: inside a function or method body; it runs too, so it counts, but is reported apart;
* ``if TYPE_CHECKING:`` imports never run and are not counted.

Circles are the strongly connected components (more than one room) of the runtime (top-level + lazy)
import graph between rooms. Floors are the layering below, written down from the current structure:
contracts, records and configs at the bottom, the code that implements them above, then what wires
implementations together (recipe, services), then the launcher, the command line and the demo. A room may
import rooms on its own floor or below; an import from a lower floor to a higher one climbs.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_PACKAGES = ("astraflow", "connectors")

# Floor -> rooms, bottom first. Every room must appear exactly once (checked at start).
FLOORS: list[tuple[str, list[str]]] = [
    ("foundations: the cluster config, the registry, devices, outage reports", [
        "astraflow", "connectors", "astraflow.config", "astraflow.registry", "astraflow.devices",
        "astraflow.background_calls",
    ]),
    ("the log and the bucket (transport, record format, what an outage of either looks like, who may do what)", [
        "astraflow.log", "astraflow.objstore", "astraflow.process", "astraflow.outage", "astraflow.security",
    ]),
    ("records: the Arrow records and the typed control records", ["astraflow.records", "astraflow.records.control"]),
    ("weights on the wire", ["astraflow.delta"]),
    ("task, tool and environment contracts", ["astraflow.tasks", "astraflow.tools", "astraflow.environments"]),
    ("models and engines", ["astraflow.models", "astraflow.engines"]),
    ("workflows", ["astraflow.workflows"]),
    ("component parts: dataflow plug-ins, SFT warm start, the embedded stack, the Prometheus endpoint", [
        "astraflow.dataflow.plugins", "astraflow.sft", "astraflow.embedded", "astraflow.prometheus",
    ]),
    ("components configured by the recipe (given it, never importing it), the metric sinks", [
        "astraflow.dataflow", "astraflow.trainer", "astraflow.report.sinks",
    ]),
    ("connectors: other engines and trainer backends", ["connectors.vllm", "connectors.megatron"]),
    ("the recipe: composes the configs of everything below", ["astraflow.recipe"]),
    ("services that read the recipe themselves", ["astraflow.raas"]),
    ("what reads a run back: archive, reports", ["astraflow.archive", "astraflow.report"]),
    ("deployment and the launcher", ["astraflow.deploy", "astraflow.launcher"]),
    ("front doors: the command line, the demo, the test support", [
        "astraflow.cli", "astraflow.demo", "astraflow.testing",
    ]),
]


@dataclass(frozen=True)
class Import:
    source: str  # module
    target: str  # module
    line: int
    kind: str  # "top", "lazy" or "typing" (under ``if TYPE_CHECKING:``, never run)


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module under the top packages."""
    found: dict[str, Path] = {}
    for top in TOP_PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if any(not (ROOT.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
                continue  # not inside a package (e.g. a script folder)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def packages(mods: dict[str, Path]) -> set[str]:
    return {name for name, path in mods.items() if path.name == "__init__.py"}


def room_of(module: str, pkgs: set[str]) -> str:
    """The deepest package holding ``module``; a loose module of a top package is its own room."""
    parts = module.split(".")
    if len(parts) == 2 and parts[0] in TOP_PACKAGES and module not in pkgs:
        return module
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in pkgs:
            return candidate
    return parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom | ast.Import, mods: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]


def imports_of(module: str, path: Path, mods: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "typing")
            for child in node.orelse:
                visit(child, kind)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _resolve(module, is_package, node, mods):
                if target.split(".")[0] in TOP_PACKAGES:
                    found.append(Import(module, target, node.lineno, kind))
            return
        if kind == "top" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            kind = "lazy"
        for child in ast.iter_child_nodes(node):
            visit(child, kind)

    visit(tree, "top")
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; components of more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(components)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on a circle or a climbing import")
    parser.add_argument("--lazy", action="store_true", help="list every lazy import across rooms")
    args = parser.parse_args()

    mods = modules()
    pkgs = packages(mods)
    rooms = sorted({room_of(m, pkgs) for m in mods})
    floor_of = {room: i for i, (_, members) in enumerate(FLOORS) for room in members}
    unplaced = sorted(set(rooms) - set(floor_of))
    stale = sorted(set(floor_of) - set(rooms))
    if unplaced or stale:
        print(f"FLOORS out of date: rooms without a floor {unplaced}, floors naming no room {stale}")
        return 2

    every = sorted({imp for m, path in mods.items() for imp in imports_of(m, path, mods)},
                   key=lambda e: (e.source, e.line, e.target))
    edges = [e for e in every if e.kind != "typing"]
    cross = [(room_of(e.source, pkgs), room_of(e.target, pkgs), e) for e in edges]
    cross = [(a, b, e) for a, b, e in cross if a != b]
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b, _ in cross:
        graph[a].add(b)
    circles = strongly_connected(graph)
    # For information: the circles that annotations alone would close (imports under TYPE_CHECKING
    # counted), and the runtime circles between modules inside one room.
    typing_graph: dict[str, set[str]] = defaultdict(set)
    module_graph: dict[str, set[str]] = defaultdict(set)
    for e in every:
        a, b = room_of(e.source, pkgs), room_of(e.target, pkgs)
        if a != b:
            typing_graph[a].add(b)
        elif e.kind != "typing" and e.target in mods and e.target != e.source:
            module_graph[e.source].add(e.target)
    typing_circles = strongly_connected(typing_graph)
    module_circles = [c for c in strongly_connected(module_graph)
                      if not any(p == m or m.startswith(p + ".") for p in c for m in c if p != m)]
    climbing = [(a, b, e) for a, b, e in cross if floor_of[b] > floor_of[a]]
    lazy = [(a, b, e) for a, b, e in cross if e.kind == "lazy"]

    print(f"rooms: {len(rooms)} on {len(FLOORS)} floors; modules: {len(mods)}")
    print(f"imports across rooms: {len(cross)} ({len(lazy)} lazy, inside functions), "
          f"room pairs: {sum(len(v) for v in graph.values())}")
    for i, (name, members) in enumerate(FLOORS):
        print(f"  floor {i:2d} {name}: {', '.join(members)}")
    print(f"circles across rooms: {len(circles)}")
    in_circle = {room: n for n, c in enumerate(circles) for room in c}
    for n, circle in enumerate(circles):
        print(f"  circle {n}: {' , '.join(circle)}")
        for a, b, e in cross:
            if in_circle.get(a) == n and in_circle.get(b) == n:
                print(f"    {e.source}:{e.line} -> {e.target} ({e.kind})")
    print(f"module circles inside a room (runtime imports, a package and its own modules not counted): "
          f"{len(module_circles)}")
    for circle in module_circles:
        print(f"  {' , '.join(circle)}")
    print(f"circles across rooms if TYPE_CHECKING imports counted (information): {len(typing_circles)}")
    for circle in typing_circles:
        print(f"  {' , '.join(circle)}")
    print(f"imports climbing to a higher floor: {len(climbing)}")
    for a, b, e in climbing:
        print(f"  {e.source}:{e.line} -> {e.target} ({e.kind}; floor {floor_of[a]} -> {floor_of[b]})")
    print(f"lazy imports across rooms: {len(lazy)}" + ("" if args.lazy else " (--lazy lists them)"))
    for _, _, e in lazy if args.lazy else ():
        print(f"  {e.source}:{e.line} -> {e.target}")
    print(json.dumps({
        "rooms": len(rooms), "floors": len(FLOORS), "modules": len(mods), "imports_across_rooms": len(cross),
        "lazy_imports_across_rooms": len(lazy), "circles": len(circles),
        "rooms_in_circles": sum(len(c) for c in circles), "climbing_imports": len(climbing),
        "climbing_lazy_imports": sum(e.kind == "lazy" for _, _, e in climbing),
        "module_circles_in_rooms": len(module_circles), "typing_circles_across_rooms": len(typing_circles),
    }))
    return 1 if args.check and (circles or climbing) else 0


if __name__ == "__main__":
    sys.exit(main())
