"""The package's layering, read from the source with ``ast`` (no module is imported):

- the shared core (``fedrelay/``: ``fedrelay.*`` outside ``fedrelay.peer``, ``fedrelay.coordinator``
  and ``fedrelay.cli``) imports none of the three;
- the coordinator (``coordinator/``) never imports the peer (``fedrelay.peer``), nor the peer the
  coordinator; neither imports the CLI;
- no import circle among fedrelay's modules, counting imports inside functions too (a function-level
  import that dodges a circle is still one).

The folders map to packages as ``pyproject.toml``'s ``[tool.setuptools.package-dir]`` says.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"fedrelay": "fedrelay", "peer": "fedrelay.peer", "coordinator": "fedrelay.coordinator",
           "cli": "fedrelay.cli"}
ROOMS = ("fedrelay.peer", "fedrelay.coordinator", "fedrelay.cli")
GENERATED = "fedrelay.v1"
TEMPLATE = "fedrelay.tasks.template"  # copied by `fedrelay new-task`, not a module of fedrelay's own


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if not name.startswith((GENERATED, TEMPLATE)):
                found[name] = path
    return found


MODULES = _modules()
# Circles in modules that other changes restructure (each entry: the modules of one circle). Remove an entry once its circle is gone; the test fails on any other circle, and on
# an entry that no longer is one.
KNOWN_CIRCLES: list[list[str]] = []


def _resolve(name: str) -> str | None:
    """The fedrelay module ``name`` is, or is in (``fedrelay.peer.transfer.X`` -> its module);
    None outside fedrelay and for the generated stubs."""
    if name.startswith((GENERATED, TEMPLATE)):
        return None
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.cache
def imports(module: str) -> frozenset[str]:
    """The fedrelay modules ``module`` imports anywhere in its source (top level or inside a
    function), generated stubs left out."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [_resolve(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # ``from fedrelay import names`` imports the module fedrelay.names; ``from fedrelay
            # import __version__`` the package fedrelay itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _resolve(base) for a in node.names]
        else:
            continue
        out |= {t for t in targets if t and t != module}
    return frozenset(out)


def room(module: str) -> str:
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), "fedrelay")


def test_the_shared_core_imports_no_daemon_and_no_cli():
    wrong = sorted(f"{m} imports {t}" for m in MODULES if room(m) == "fedrelay"
                   for t in imports(m) if room(t) != "fedrelay")
    assert wrong == []


def test_the_coordinator_and_the_peer_import_only_the_shared_core():
    wrong = sorted(f"{m} imports {t}" for m in MODULES if room(m) in ("fedrelay.peer", "fedrelay.coordinator")
                   for t in imports(m) if room(t) not in ("fedrelay", room(m)))
    assert wrong == []


def test_no_import_circle():
    graph = {m: imports(m) for m in MODULES}
    # Tarjan's strongly connected components: a component of more than one module is a circle
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert sorted(circles) == sorted(KNOWN_CIRCLES)


def test_the_layout_reads_every_room():
    # the checks above see modules of every folder (a moved folder would make them vacuous)
    assert {room(m) for m in MODULES} == {"fedrelay", *ROOMS}
    assert "fedrelay.transport" in imports("fedrelay.server")
