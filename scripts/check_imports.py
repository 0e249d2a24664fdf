"""The import graph of the source tree, read with `ast`: every `import` counts, at module level, in
a function body, or under `if TYPE_CHECKING:`.

Checks (exit 1 on failure, one line per problem):
  1. no import cycle between layercut modules (Tarjan's strongly connected components);
  2. imports of `layercut.*` inside function bodies happen only in the entry points listed in
     ENTRY_POINTS (they keep `layercut --help` and `import layercut` free of torch), and there
     are at most MAX_BODY_IMPORTS of them.

    python scripts/check_imports.py            # the check (CI runs it through check_package.sh)
    python scripts/check_imports.py --report   # also print the counts and every body import
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> the package it installs as (pyproject.toml [tool.setuptools.package-dir])
FOLDERS = {"layercut": "layercut", "compress": "layercut.compress", "calibrate": "layercut.calibrate",
           "heal": "layercut.heal", "export": "layercut.export"}
# Modules whose function bodies may import layercut modules: the entry points that must stay
# light (`layercut --help`, `import layercut`), and the CLI command table that loads one command.
ENTRY_POINTS = {
    "layercut",                          # `import layercut` stays torch-free; the API loads on use
    "layercut.api",                      # each API function loads its stage on call
    "layercut.cli",                      # the console script
    "layercut.compress.workflow.cli",    # argparse first, then the chosen command
    "layercut.compress.workflow.stages", # the stage table: a stage module loads when it runs
    "layercut.export",                   # `layercut.export(...)` forwards to the API on call
    "layercut.heal",                     # `layercut.heal(...)` forwards to the API on call
}
MAX_BODY_IMPORTS = 40


def modules() -> dict[str, Path]:
    """Module name -> file, for every .py file of the five source folders (tasks data excluded)."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if "tasks" in parts:
                continue
            out[".".join([package, *parts])] = path
    return out


def _resolve(name: str, node: ast.ImportFrom | ast.Import, here: str, is_pkg: bool, known: set[str]):
    """The layercut modules one import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "layercut"]
    if node.level:
        base = here.split(".") if is_pkg else here.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    if mod.split(".")[0] != "layercut":
        return []
    found = []
    for alias in node.names:
        sub = f"{mod}.{alias.name}"
        found.append(sub if sub in known else mod)
    return found


class _Walker(ast.NodeVisitor):
    def __init__(self, here: str, is_pkg: bool, known: set[str]):
        self.here, self.is_pkg, self.known = here, is_pkg, known
        self.depth = 0
        self.edges: list[tuple[str, int, bool]] = []  # (target, line, in a function body)

    def _func(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _func

    def _imp(self, node):
        for target in _resolve("", node, self.here, self.is_pkg, self.known):
            self.edges.append((target, node.lineno, self.depth > 0))

    visit_Import = visit_ImportFrom = _imp


def graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    mods = modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    body: list[tuple[str, int, str]] = []  # one per import statement
    seen: set[tuple[str, int]] = set()
    for name, path in mods.items():
        walker = _Walker(name, path.name == "__init__.py", known)
        walker.visit(ast.parse(path.read_text(), str(path)))
        for target, line, in_body in walker.edges:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                edges[name].add(target)
            if in_body and (name, line) not in seen:
                seen.add((name, line))
                body.append((name, line, target))
    return edges, body


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="print counts and every body import")
    args = parser.parse_args(argv)
    edges, body = graph()
    problems = []
    for comp in cycles(edges):
        problems.append(f"import cycle of {len(comp)} modules: {' '.join(comp)}")
    outside = [(m, line, t) for m, line, t in body if m not in ENTRY_POINTS]
    for mod, line, target in outside:
        problems.append(f"{mod}:{line} imports {target} inside a function (not an entry point)")
    if len(body) > MAX_BODY_IMPORTS:
        problems.append(f"{len(body)} function-body imports of layercut modules, at most {MAX_BODY_IMPORTS}")
    if args.report:
        n_edges = sum(len(v) for v in edges.values())
        print(f"{len(edges)} modules, {n_edges} import edges, {len(body)} function-body imports "
              f"of layercut modules ({len(outside)} outside the entry points)")
        for mod, line, target in body:
            print(f"  {mod}:{line} -> {target}")
    for p in problems:
        print(f"check_imports: {p}")
    if not problems:
        print(f"check_imports: no cycle among {len(edges)} modules; {len(body)} function-body imports, "
              f"all in entry points")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
