"""The import graph of vkml's modules (every import statement, those inside functions too): no
cycle, each layer imports only its own and lower layers, and the backends' and the ONNX front
end's third-party packages stay in them. Read from the source (ast), so nothing is imported and
no device is needed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vkml"

# Lowest first. A module may import modules of its own layer and of the layers before it.
LAYERS: list[tuple[str, ...]] = [
    ("vkml.errors", "vkml.expr", "vkml.threads", "vkml.cachedir", "vkml.interrupts",
     "vkml.files"),
    ("vkml.hal",),
    ("vkml.graph", "vkml.optim", "vkml.nn"),
    ("vkml.kernels",),
    ("vkml.ops",),
    ("vkml.models", "vkml.importers"),  # graphs built from code or read from model files
    ("vkml.compiler",),
    ("vkml.vk", "vkml.webgpu"),  # the backends: the compiler above never names one
    ("vkml.runtime",),
    ("vkml.session",),
    ("vkml", "vkml.demo", "vkml.dump", "vkml.__main__"),  # the front door and the command line
]
BACKENDS = ("vkml.vk", "vkml.webgpu")
# The one module outside the backends that names them: it makes the device's backend.
BACKEND_FACTORY = "vkml.runtime.device"
# Third-party packages only one part of vkml imports (DESIGN.md: everything above the backends
# is backend-free; the model-file front end alone reads ONNX).
CONFINED = {"vulkan": "vkml.vk", "wasmtime": "vkml.vk", "wgpu": "vkml.webgpu",
            "onnx": "vkml.importers"}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def vkml_module(name: str) -> str:
    """The module of vkml that `import name` loads last (a name inside a module: that module)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(module: str) -> tuple[set[str], set[str]]:
    """(vkml modules, top-level third-party packages) that `module` imports anywhere in it."""
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from vkml import nn` imports the module vkml.nn; `from vkml.x import f`, vkml.x
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                     else node.module for a in node.names]
        else:
            continue
        for name in names:
            if within(name, "vkml"):
                ours.add(vkml_module(name))
            else:
                theirs.add(name.partition(".")[0])
    ours.discard(module)
    return ours, theirs


GRAPH = {m: imports(m)[0] for m in MODULES}


def layer(module: str) -> int:
    best = max(((len(p), i) for i, group in enumerate(LAYERS) for p in group
                if within(module, p)), default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best[1]


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_no_import_cycle():
    # Depth-first search; a module met again while still on the path closes a cycle.
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == "open":
                cycle = path[path.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [f"{m} ({layer(m)}) imports {n} ({layer(n)})" for m, deps in GRAPH.items()
              for n in deps if layer(n) > layer(m)]
    assert not upward, "\n".join(upward)


def test_the_compiler_imports_neither_runtime_nor_session():
    wrong = [(m, n) for m, deps in GRAPH.items() if within(m, "vkml.compiler") for n in deps
             if any(within(n, p) for p in ("vkml.runtime", "vkml.session", *BACKENDS))]
    assert not wrong, wrong


def test_backends_are_named_by_their_factory_only():
    wrong = [(m, n) for m, deps in GRAPH.items() for n in deps
             if any(within(n, b) and not within(m, b) for b in BACKENDS)
             and layer(m) < len(LAYERS) - 1 and m != BACKEND_FACTORY]
    assert not wrong, wrong


def test_only_the_vulkan_backend_imports_naga():
    users = {m for m, deps in GRAPH.items() if "vkml.vk.naga" in deps}
    assert users and all(within(m, "vkml.vk") for m in users), users


@pytest.mark.parametrize("package", sorted(CONFINED))
def test_confined_dependencies_stay_where_they_belong(package):
    users = {m for m in MODULES if package in imports(m)[1]}
    assert users and all(within(m, CONFINED[package]) for m in users), users
