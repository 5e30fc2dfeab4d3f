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
