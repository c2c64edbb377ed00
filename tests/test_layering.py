"""The package's import graph, measured the way a reviewer would: parsed from the source (no import runs), it
must have no module-level cycle and no upward arrow between the floors of docs/architecture.md.

    python tests/test_layering.py     # the floors, the arrows between them, the biggest files and functions

Floors, top to bottom; a module imports its own floor and the floors below it, never one above (imports
inside functions count too: a lazy import is still an arrow). `kernels/` imports nothing of pagedchat.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FLOORS = [   # (name, module prefixes), top to bottom
    ("front door", ["pagedchat.cli", "pagedchat.commands"]),
    ("front ends", ["pagedchat.chat", "pagedchat.serve", "pagedchat.web", "pagedchat.bench"]),
    ("shared by the front ends", ["pagedchat.settings", "pagedchat.prompts", "pagedchat.registry",
                                  "pagedchat.remote", "pagedchat.reasoning"]),
    ("engine API", ["pagedchat.engine.engine", "pagedchat.engine.outputs", "pagedchat.engine",
                    "pagedchat.quick"]),   # quick: the torch-free engine of a one-shot run
    ("engine: ways of decoding", ["pagedchat.engine.decoding"]),
    ("engine: core", ["pagedchat.engine.core"]),
    ("engine: KV pool and tiers", ["pagedchat.engine.kv"]),
    ("native CPU step (binds a loaded model)", ["pagedchat.native"]),
    ("model", ["pagedchat.model"]),
    ("kernels", ["pagedchat.kernels"]),
    ("base: errors, dtypes, words, sizes, threads, folders", ["pagedchat.errors", "pagedchat.dtypes", "pagedchat.words",
                                                              "pagedchat.memory", "pagedchat.threads", "pagedchat.dirs",
                                                              "pagedchat"]),
]


# -- the graph -----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def modules() -> dict[str, Path]:
    """Every module of the package by its import name (kernels/ is installed as pagedchat.kernels)."""
    found = {}
    for folder, package in ((ROOT / "pagedchat", "pagedchat"), (ROOT / "kernels", "pagedchat.kernels")):
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict) -> list[tuple[str, bool]]:
    """(imported pagedchat module, at module level) for each import in the file. `if TYPE_CHECKING:` blocks
    never run; imports inside a function run when it is called (not module level, still an arrow)."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((target, top) for target in _targets(name, path, child, known))
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return found


def _targets(name: str, path: Path, node, known: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("pagedchat")]
    if node.level:      # relative: from the importer's package
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if not base.startswith("pagedchat"):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


@functools.lru_cache(maxsize=2)
def graph(runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the pagedchat modules it imports (runtime_only: those imported when it is imported, package
    __init__s of the target included, since importing a.b.c runs a.b first)."""
    known = modules()
    edges = {}
    for name, path in known.items():
        targets = set()
        for target, top in imports(name, path, known):
            if runtime_only and not top:
                continue
            targets.add(target)
            if runtime_only:
                parts = target.split(".")
                targets.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                               if p in known and not (name + ".").startswith(p + "."))
        edges[name] = {t for t in targets if t in known and t != name}
    return edges


def floor_of(module: str) -> int:
    """Index in FLOORS of the longest prefix naming this module (0 = top)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best is not None, f"{module} is on no floor: add it to FLOORS (tests/test_layering.py) and the docs"
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


# -- the tests -----------------------------------------------------------------------------------------------------
def test_every_module_is_on_a_floor():
    for module in modules():
        floor_of(module)


def test_no_module_level_import_cycle():
    assert cycles(graph(runtime_only=True)) == []


def test_no_upward_arrow_between_floors():
    upward = [f"{a} ({FLOORS[floor_of(a)][0]}) -> {b} ({FLOORS[floor_of(b)][0]})"
              for a, targets in graph().items() for b in sorted(targets) if floor_of(b) < floor_of(a)]
    assert upward == [], "\n".join(upward)


def test_kernels_import_nothing_else_of_pagedchat():
    outside = [f"{a} -> {b}" for a, targets in graph().items() if a.startswith("pagedchat.kernels")
               for b in targets if not b.startswith("pagedchat.kernels")]
    assert outside == []


def test_the_checks_catch_what_they_are_for():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floor_of("pagedchat.engine.core.scheduler") > floor_of("pagedchat.engine.decoding.sampler")
    assert floor_of("pagedchat.engine.kv.block_pool") > floor_of("pagedchat.engine.core.runner")
    assert floor_of("pagedchat.chat.controller") > floor_of("pagedchat.commands.run")


# -- the report (python tests/test_layering.py) --------------------------------------------------------------------
def report() -> str:
    edges = graph()
    lines = ["floors, top to bottom (and the floors each one imports):"]
    for i, (name, prefixes) in enumerate(FLOORS):
        below = sorted({floor_of(b) for a, targets in edges.items() if floor_of(a) == i for b in targets} - {i})
        lines.append(f"  {i:2d} {name:45s} -> {', '.join(str(j) for j in below) or '-'}")
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in modules().values()),
                   reverse=True)
    lines += ["", "biggest files (lines):"] + [f"  {n:5d}  {path}" for n, path in sizes[:12]]
    functions = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.lineno}",
                                  node.name))
    lines += ["", "biggest functions (lines):"] + [f"  {n:5d}  {where} {fn}" for n, where, fn in
                                                  sorted(functions, reverse=True)[:12]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())


def test_every_package_is_installed():
    """`pip install .` (not -e) installs only the packages pyproject lists: a new folder must be listed."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "pagedchat").rglob("__init__.py")}
    found |= {"pagedchat.kernels"}
    assert found <= listed, f"not in pyproject's packages: {sorted(found - listed)}"
