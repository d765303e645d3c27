"""Print the import graph between layers; fail on an upward import or an import cycle.

    python tools/import_graph.py [--modules] [--root DIR]

Every module of `seedflood_p2p/`, `peer/`, `bootstrap/` and `seedflood/` is parsed with
`ast` (nothing is imported, so the check needs neither torch nor the network stack). A
module's layer is its folder under `seedflood_p2p/` (the package's own `__init__` counts as
the lowest layer); `peer/`, `bootstrap/` and `seedflood/` (the `seedflood` command) are the
top layer, "daemon". The order is read from `LAYERS` in `seedflood_p2p/__init__.py`, where
it is stated once.

A layer may be split into rooms: its `__init__.py` states `ROOMS` (lowest first), each a
sub-package or module directly under the layer's folder. Inside such a layer an import
may not go up a room either (`seedflood_p2p/network/__init__.py` orders transport <
monitoring < peers < transfer < settings < gossip < host), and every module must sit in a
room.

Every import statement counts, at module level or inside a function, and under
`if TYPE_CHECKING:` too: a function-local import is still a dependency, and hiding one
is how cycles go unnoticed. Only `importlib.import_module(name)` is invisible here.

Exit status 1, with every offending import listed, if a module imports from a higher
layer or modules import each other in a cycle (directly or through others).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "seedflood_p2p"
DAEMONS = ("peer", "bootstrap", "seedflood")
DAEMON_LAYER = "daemon"


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module
    path: Path
    line: int


def read_layers(root: Path) -> list[str]:
    """`LAYERS` from the package's __init__.py, lowest first, then the daemon layer."""
    tree = ast.parse((root / PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "LAYERS" for t in node.targets
        ):
            return [*ast.literal_eval(node.value), DAEMON_LAYER]
    raise SystemExit(f"no LAYERS in {root / PACKAGE / '__init__.py'}")


def find_modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} for the package and the daemons."""
    modules = {}
    for top in (PACKAGE, *DAEMONS):
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def layer_of(module: str, layers: list[str]) -> str:
    parts = module.split(".")
    if parts[0] in DAEMONS:
        return DAEMON_LAYER
    if len(parts) == 1:
        return layers[0]  # the package __init__: version and LAYERS, imports nothing
    if parts[1] in layers[:-1]:
        return parts[1]
    raise SystemExit(f"{module} is in no layer: move it into one of {', '.join(layers[:-1])}")


def read_rooms(root: Path, layers: list[str]) -> dict[str, list[str]]:
    """{layer: its ROOMS, lowest first} for the layers whose __init__.py states them."""
    rooms = {}
    for name in layers[:-1]:
        init = root / PACKAGE / name / "__init__.py"
        if not init.exists():
            continue
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "ROOMS" for t in node.targets
            ):
                rooms[name] = list(ast.literal_eval(node.value))
    return rooms


def room_of(module: str, rooms: dict[str, list[str]]) -> str | None:
    """The room of a module in a layer with rooms ("" for the layer's own __init__)."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2 or parts[1] not in rooms:
        return None
    if len(parts) == 2:
        return ""
    if parts[2] not in rooms[parts[1]]:
        raise SystemExit(
            f"{module} is in no room of {parts[1]}: move it into one of "
            + ", ".join(rooms[parts[1]])
        )
    return parts[2]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module `name` starts with (None for third-party imports)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def find_edges(modules: dict[str, Path]) -> list[Edge]:
    edges = []
    for source, path in modules.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from a.b import c` imports module a.b.c if there is one, else names of a.b
                targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
                targets = [t if t in modules else base for t in targets]
            resolved = {_resolve(name, modules) for name in targets} - {None, source}
            edges += [Edge(source, target, path, node.lineno) for target in sorted(resolved)]
    return edges


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return cycles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--modules", action="store_true", help="also list module edges")
    args = parser.parse_args(argv)

    layers = read_layers(args.root)
    rank = {name: i for i, name in enumerate(layers)}
    modules = find_modules(args.root)
    edges = find_edges(modules)
    layer = {m: layer_of(m, layers) for m in modules}
    missing = [name for name in layers[:-1] if f"{PACKAGE}.{name}" not in modules]

    print("layers, lowest first: " + " < ".join(layers))
    pairs = {(e.source, e.target) for e in edges}
    counts = Counter((layer[s], layer[t]) for s, t in pairs)
    print("layer -> layer: modules importing (distinct module pairs)")
    for (low, high), n in sorted(counts.items(), key=lambda kv: (rank[kv[0][0]], rank[kv[0][1]])):
        mark = "   UPWARD" if rank[high] > rank[low] else ""
        print(f"  {low:>9} -> {high:<9} {n:3d}{mark}")
    if args.modules:
        print("module -> module")
        for source, target in sorted(pairs):
            print(f"  {source} -> {target}")

    upward = [e for e in edges if rank[layer[e.target]] > rank[layer[e.source]]]
    rooms = read_rooms(args.root, layers)
    room = {m: room_of(m, rooms) for m in modules}
    for e in edges:
        if layer[e.source] != layer[e.target] or room[e.source] is None:
            continue
        order = ["", *rooms[layer[e.source]]]
        if order.index(room[e.target]) > order.index(room[e.source]):
            print(
                f"upward import: {e.path.relative_to(args.root)}:{e.line}: {e.source} "
                f"(room {room[e.source]}) imports {e.target} (room {room[e.target]})"
            )
            upward.append(e)
    for name, order in rooms.items():
        print(f"rooms of {name}, lowest first: " + " < ".join(order))
    cycles = find_cycles(edges)
    for e in upward:
        if layer[e.source] == layer[e.target]:
            continue  # a room-order import, printed above
        print(
            f"upward import: {e.path.relative_to(args.root)}:{e.line}: {e.source} "
            f"({layer[e.source]}) imports {e.target} ({layer[e.target]})"
        )
    for cycle in cycles:
        print("import cycle: " + " <-> ".join(cycle))
    for name in missing:
        print(f"layer {name} has no folder {PACKAGE}/{name}/")
    ok = not (upward or cycles or missing)
    print(
        f"{len(modules)} modules, {len(pairs)} module edges: "
        + ("no upward import, no cycle" if ok else "FAILED")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
