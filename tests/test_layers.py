"""The folders are the layers (docs/architecture.md): a package imports only packages of its own layer
or below, so data flows one way, trace -> memory -> eviction -> scheduler -> executors -> engine ->
sweep/whatif/report -> cli. Every import statement counts, including those inside functions."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = {  # package -> layer (design.md's numbering; errors is the shared base)
    "kvbench.errors": 0, "kvbench.jsonio": 0, "kvbench.provenance": 0, "kvbench.jit": 0,
    "kvbench.trace": 1, "kvbench.workloads": 1,
    "kvbench.memory": 2,
    "kvbench.eviction": 3,
    "kvbench.scheduler": 4,
    "kvbench.executors": 5, "kvbench.kernels": 5,
    "kvbench.engine": 6,
    "kvbench.sweep": 7, "kvbench.whatif": 7, "kvbench.report": 7,
    "kvbench.cli": 8, "kvbench.__main__": 8,
}
# where each installed package's files are (kernels/ and workloads/ are mapped into kvbench)
FOLDERS = {"kvbench": "kvbench", "kvbench.kernels": "kernels", "kvbench.workloads": "workloads"}


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name, by its longest listed prefix; None outside kvbench."""
    if module == "kvbench":  # the package's own __init__: __version__ only, a base
        return 0
    best = None
    for pkg, layer in LAYERS.items():
        if module == pkg or module.startswith(pkg + "."):
            if best is None or len(pkg) > len(best[0]):
                best = (pkg, layer)
    if best is None and module.startswith("kvbench."):
        raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS")
    return None if best is None else best[1]


def modules() -> list[tuple[str, str]]:
    out = []
    for pkg, folder in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, files in os.walk(base):
            rel = os.path.relpath(dirpath, base)
            if pkg == "kvbench" and rel.split(os.sep)[0] in ("kernels", "workloads"):
                continue
            for f in files:
                if f.endswith(".py"):
                    parts = [] if rel == "." else rel.split(os.sep)
                    name = ".".join([pkg, *parts] + ([] if f == "__init__.py" else [f[:-3]]))
                    out.append((name, os.path.join(dirpath, f)))
    return out


def imports(path: str, module: str) -> list[tuple[int, str]]:
    """(line, imported kvbench module) for every import statement in a file."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("kvbench")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("kvbench"):
                continue
            for a in node.names:  # `from kvbench import memory` imports the subpackage memory
                out.append((node.lineno, f"{base}.{a.name}" if base == "kvbench" and a.name != "__version__" else base))
    return out


def test_every_module_is_in_a_layer():
    mods = modules()
    assert len(mods) > 40
    for name, _ in mods:
        layer_of(name)


@pytest.mark.parametrize("name,path", modules(), ids=lambda v: v if "." in str(v) and os.sep not in str(v) else "")
def test_no_layer_imports_a_higher_one(name, path):
    if name == "kvbench":  # the public face names things of every layer, imported on first use
        return
    mine = layer_of(name)
    for line, target in imports(path, name):
        theirs = layer_of(target)
        assert theirs is None or theirs <= mine, (
            f"{os.path.relpath(path, ROOT)}:{line}: {name} (layer {mine}) imports {target} (layer {theirs})")


# -- one room per idea, one home per rule --------------------------------------------------------
def _graph() -> dict[str, set[str]]:
    """Module -> the kvbench modules it imports (any import statement, at the top or in a function),
    each resolved to a module of the tree (``from kvbench.x import y`` names module x, or x.y where
    y is a module)."""
    mods = dict(modules())
    names = set(mods)
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for _, target in imports(path, name):
            while target and target not in names:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                deps.add(target)
        out[name] = deps
    return out


def test_no_import_circle():
    """No two modules import each other, directly or around a loop, even through an import placed in a
    function to dodge the cycle at load time. The package __init__ files re-export their modules'
    names (and kvbench's own lazily names every layer): they are left out."""
    graph = {m: {d for d in deps if not _is_package(d)} for m, deps in _graph().items() if not _is_package(m)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                loop = stack[stack.index(d):] + [d]
                raise AssertionError("import circle: " + " -> ".join(loop))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _is_package(module: str) -> bool:
    for pkg, folder in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):  # kvbench.kernels before kvbench
        if module == pkg or module.startswith(pkg + "."):
            rel = module[len(pkg):].lstrip(".").replace(".", os.sep)
            return os.path.isdir(os.path.join(ROOT, folder, rel)) if rel else True
    return False


MAX_LINES = 700
# modules allowed past MAX_LINES, each with its reason (none today: a module that grows past it splits)
LONG_MODULES: dict[str, str] = {}


@pytest.mark.parametrize("name,path", modules(), ids=lambda v: v if "." in str(v) and os.sep not in str(v) else "")
def test_no_module_over_700_lines(name, path):
    n = sum(1 for _ in open(path, encoding="utf-8"))
    assert n <= MAX_LINES or name in LONG_MODULES, f"{name} has {n} lines: split it along its seams"


PROBE_FREE = ("kvbench.engine", "kvbench.scheduler", "kvbench.eviction")


def test_no_capability_probes_in_engine_scheduler_eviction():
    """What a KV manager, a pool or an executor can do is declared (kvbench.memory.contracts,
    kvbench.executors.base), never probed: no hasattr, and no getattr with a default, in the layers
    that use them."""
    found = []
    for name, path in modules():
        if not name.startswith(PROBE_FREE):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                    node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "capability probes:\n" + "\n".join(found)
