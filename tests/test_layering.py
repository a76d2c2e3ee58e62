"""The package's imports flow one way (ARCHITECTURE.md, "What may import what").

Every import in the package is read from the source, wherever it stands (module level or
inside a function); only those under ``if TYPE_CHECKING:`` are left out, since they never
run. Each module belongs to one layer; it may import its own layer and those below.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "spnl_backend"

# Lowest first. A module belongs to the layer of its longest listed prefix.
LAYERS: tuple[tuple[str, ...], ...] = (
    # what everything may use: errors, logging, memory arithmetic, and the catalogue of
    # compression methods' names that settings validate against
    (
        "spnl_backend.errors",
        "spnl_backend.log",
        "spnl_backend.memory",
        "spnl_backend.compression.registry",
    ),
    ("spnl_backend.settings",),
    ("spnl_backend.kernels",),
    ("spnl_backend.quant",),
    ("spnl_backend.models",),
    ("spnl_backend.compression",),
    ("spnl_backend.loader",),
    ("spnl_backend.engine",),
    ("spnl_backend.request", "spnl_backend.backend", "spnl_backend"),
    ("spnl_backend.cli",),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, rank = "", -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, index
    assert rank >= 0, f"{module} belongs to no layer; add it to LAYERS and ARCHITECTURE.md"
    return rank


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _running_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    return imports_in(path.read_text(), module, is_package=path.name == "__init__.py")


def imports_in(source: str, module: str, is_package: bool) -> set[str]:
    """The package's modules that ``source`` (the text of ``module``) imports; a ``from X
    import y`` of a submodule ``y`` counts as importing ``X.y``."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in _running_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_down(module):
    upward = sorted(
        target
        for target in GRAPH[module]
        if layer_of(target) > layer_of(module)
        and not module.startswith(target + ".")  # a submodule runs its package's __init__
    )
    assert not upward, f"{module} (layer {layer_of(module)}) imports from above: {upward}"


def test_no_import_cycles():
    """Depth-first search over the module graph; a back edge is a cycle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if module.startswith(target + "."):
                continue  # a package's own __init__, which runs first anyway
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_environment_is_read_only_by_settings():
    readers = sorted(
        module
        for module, path in MODULES.items()
        if not module.startswith("spnl_backend.settings")
        and any(word in path.read_text() for word in ("os.environ", "os.getenv", "getenv("))
    )
    assert not readers, f"read the environment outside settings/: {readers}"


def test_the_check_finds_imports_that_run_and_skips_type_only_ones():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from ..engine import engine\n"
        "if TYPE_CHECKING:\n"
        "    from ..backend import Backend\n"
        "def late():\n"
        "    from . import thresholds\n"
    )
    found = imports_in(source, "spnl_backend.kernels.sets", is_package=False)
    assert found == {
        "spnl_backend.kernels",  # `from . import x` runs the package first
        "spnl_backend.engine",
        "spnl_backend.engine.engine",
        "spnl_backend.kernels.thresholds",
    }
    assert layer_of("spnl_backend.engine.engine") > layer_of("spnl_backend.kernels.sets")
