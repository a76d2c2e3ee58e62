"""The package's imports flow one way (ARCHITECTURE.md, "Layers").

Every import in the package is read from the source, wherever it stands (module level or
inside a function); only those under ``if TYPE_CHECKING:`` are left out, since they never
run. Importing ``a.b.c`` also runs the packages ``a`` and ``a.b``, so those count too. Each
module belongs to one layer; it may import its own layer and those below.
"""

import ast
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "spnl_backend"

# Lowest first. A module belongs to the layer of its longest listed prefix; a name
# starting with "=" is that one module only (a package's __init__, not its modules).
LAYERS: tuple[tuple[str, ...], ...] = (
    # what everything may use: errors, logging, the version, memory arithmetic, the library
    # threads' signal mask, a request's sampling parameters (which the engine reads), and
    # the registry of compression methods whose names settings validate against
    (
        "spnl_backend.errors",
        "spnl_backend.log",
        "spnl_backend.signals",
        "spnl_backend.memory",
        "spnl_backend.sampling",
        "spnl_backend.compressors",
        "spnl_backend.version",
    ),
    ("spnl_backend.settings",),
    ("spnl_backend.pic",),
    ("spnl_backend.kernels",),
    ("spnl_backend.quant",),
    ("spnl_backend.models",),
    ("spnl_backend.compression",),
    ("spnl_backend.loader",),
    ("spnl_backend.engine",),
    # a model over several ranks: the group, each rank's share, starting and following
    ("spnl_backend.distributed",),
    # a request's checks, PIC's ways in (request parsing, beside them: spnl's span queries
    # read and tokenized, their messages templated; a backend's PIC prompts made and
    # checked), its output constraints (their specs are request checks; their matchers the
    # engine's), its results, the backend, and loading one
    (
        "spnl_backend.request",
        "spnl_backend.plain",
        "spnl_backend.pic.pieces",
        "spnl_backend.pic.prompts",
        "spnl_backend.pic.query",
        "spnl_backend.pic.spans",
        "spnl_backend.pic.turns",
        "spnl_backend.constrain",
        "spnl_backend.tools",
        "spnl_backend.reasoning",
        "spnl_backend.results",
        "spnl_backend.backend",
        "spnl_backend.load",
        "=spnl_backend",
    ),
    ("spnl_backend.server",),
    ("spnl_backend.cli", "spnl_backend.terminal_chat"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, rank = "", -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix.startswith("="):
                if module == prefix[1:]:
                    return index
            elif (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
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
    parents = {name.rsplit(".", depth)[0] for name in found for depth in range(1, name.count("."))}
    return {name for name in found | parents if name in MODULES and name != module}


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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (each node's targets), as the path that closes it; None if it
    has none. Depth-first search: a target still on the current path is a back edge."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    # a package's own __init__ runs first anyway: not an edge
    graph = {m: {t for t in GRAPH[m] if not m.startswith(t + ".")} for m in GRAPH}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def subpackage_of(module: str) -> str | None:
    """The subpackage (a folder of ``spnl_backend``) that holds ``module``; None for the
    root package and its top-level modules (`backend`, `request`, `errors` ...)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and MODULES[module].name == "__init__.py"):
        return parts[1]
    return None


def subpackage_graph() -> dict[str, dict[str, tuple[str, str]]]:
    """Each subpackage's imports of other subpackages, with one import that makes each."""
    graph: dict[str, dict[str, tuple[str, str]]] = {}
    for module, targets in GRAPH.items():
        for target in targets:
            here, there = subpackage_of(module), subpackage_of(target)
            if here and there and here != there:
                graph.setdefault(here, {}).setdefault(there, (module, target))
    return graph


def test_the_subpackages_import_each_other_without_a_cycle():
    """Subpackages form a graph without cycles, so each can be read (and tested) over
    those below it: settings, for one, never reach the kernels that read them."""
    graph = subpackage_graph()
    cycle = find_cycle({node: set(targets) for node, targets in graph.items()})
    if cycle is not None:
        steps = [
            f"{a} -> {b} ({' imports '.join(graph[a][b])})" for a, b in itertools.pairwise(cycle)
        ]
        pytest.fail("subpackage import cycle: " + "; ".join(steps))


def test_the_cycle_search_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert subpackage_of("spnl_backend.kernels.cpu") == "kernels"
    assert subpackage_of("spnl_backend.settings") == "settings"
    assert subpackage_of("spnl_backend.request") is None


def reads_environment(source: str) -> bool:
    """``os.environ``/``os.getenv`` used, or ``environ``/``getenv`` imported from os."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            return True
        imported = {a.name for a in node.names} if isinstance(node, ast.ImportFrom) else set()
        if getattr(node, "module", None) == "os" and imported & {"environ", "getenv", "putenv"}:
            return True
    return False


def test_the_environment_is_read_only_by_settings():
    readers = sorted(
        module
        for module, path in MODULES.items()
        if not module.startswith("spnl_backend.settings") and reads_environment(path.read_text())
    )
    assert not readers, f"read the environment outside settings/: {readers}"
    assert reads_environment("from os import environ as e\n")
    assert reads_environment("import os\nx = os.getenv('A')\n")
    assert not reads_environment("import os\nx = os.path.join('a')\n")
    assert reads_environment("from os import path\nx = __import__('os').environ\n")


# Imports by name at run time, which the graph above cannot see: each is listed with why.
DYNAMIC_IMPORTS = {
    # the names the package hands out on first use (its own modules, below it)
    "spnl_backend": "import_module(",
    "spnl_backend.compression": "importlib.import_module(",
    # the built-in compression methods, loaded like an entry point's plugin (ARCHITECTURE.md)
    "spnl_backend.compressors": "importlib.import_module(BUILT_IN_MODULE)",
}


def test_every_import_by_name_is_a_known_one():
    found = {
        module
        for module, path in MODULES.items()
        if "import_module(" in path.read_text() or "__import__(" in path.read_text()
    }
    assert found == set(DYNAMIC_IMPORTS)
    for module, call in DYNAMIC_IMPORTS.items():
        assert call in MODULES[module].read_text()


def test_settings_load_nothing_above_them():
    """What ``import spnl_backend.settings`` brings in, measured in a fresh interpreter:
    the registry of compression methods, and nothing above settings."""
    code = (
        "import json, sys\n"
        "import spnl_backend.settings\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('spnl_backend'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    # The root package runs first whatever is imported; it loads only `errors` itself.
    above = [
        m for m in loaded if m != "spnl_backend" and layer_of(m) > layer_of("spnl_backend.settings")
    ]
    assert above == [], f"importing settings loads modules above them: {above}"


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
