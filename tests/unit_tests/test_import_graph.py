"""The package's import graph (SPEC section 9): no circles, no private names across packages,
and ``megatron.core`` never imports ``megatron.training``.

Every ``import`` / ``from ... import`` statement of every module under ``megatron/`` counts,
wherever it is written (module level, inside a function, under ``if``): Python runs a
function-level import as surely as a top-level one, only later. Importing ``a.b.c`` also
runs the ``__init__`` of packages ``a.b`` and ``a`` (except packages the importer itself is
in, which are already running), so those are edges too. The checks are pure functions of
``{module name: source}``; the negative controls feed them small invented packages.
"""

import ast
import functools
import itertools
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Set, Tuple

import pytest

pytestmark = pytest.mark.world(1)  # reads source files only

ROOT = Path(__file__).resolve().parents[2]

# Private names imported across packages that another change in flight removes; each entry
# names the change. ``test_pending_exceptions_still_occur`` fails once an entry is obsolete.
PENDING: Set[Tuple[str, str]] = set()


class Module(NamedTuple):
    source: str
    is_package: bool


class Edge(NamedTuple):
    importer: str
    target: str
    line: int


class PrivateImport(NamedTuple):
    importer: str
    line: int
    source: str
    name: str


@functools.lru_cache(maxsize=None)
def _read_package(root: Path) -> Tuple[Tuple[str, Module], ...]:
    modules = []
    for path in sorted((root / "megatron").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules.append((name, Module(path.read_text(encoding="utf-8"), is_package)))
    return tuple(modules)


def package_modules(root: Path = ROOT) -> Dict[str, Module]:
    """``{dotted name: Module}`` for every ``.py`` file under ``root/megatron``."""
    return dict(_read_package(root))


def import_edges(modules: Dict[str, Module]) -> List[Edge]:
    """Every module -> module import (see the module docstring), self-edges dropped."""
    edges = []
    for importer, (source, is_package) in modules.items():
        package = importer if is_package else importer.rpartition(".")[0]
        for target, line, _ in _imports(source, package, modules):
            for name in [target] + _ancestor_packages(target, importer, modules):
                if name != importer:
                    edges.append(Edge(importer, name, line))
    return edges


def private_imports(modules: Dict[str, Module]) -> List[PrivateImport]:
    """``from X import _name`` where X's package is not the importer's package."""
    found = []
    for importer, (source, is_package) in modules.items():
        package = importer if is_package else importer.rpartition(".")[0]
        for target, line, name in _imports(source, package, modules):
            if name is None or not _is_private(name):
                continue
            source_package = target if modules[target].is_package else target.rpartition(".")[0]
            if source_package != package:
                found.append(PrivateImport(importer, line, target, name))
    return found


def import_cycles(edges: List[Edge]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: Dict[str, Set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    counter = itertools.count()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = next(counter)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
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
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def describe_cycle(cycle: List[str], edges: List[Edge]) -> str:
    """The edges inside one cycle, as ``a:line -> b`` lines."""
    members = set(cycle)
    inside = sorted({(e.importer, e.line, e.target) for e in edges}, key=str)
    lines = [f"  {a}:{line} -> {b}" for a, line, b in inside if a in members and b in members]
    return "\n".join(lines)


def _imports(
    source: str, package: str, modules: Dict[str, Module]
) -> Iterator[Tuple[str, int, object]]:
    """(target module, line, imported name or None) for every import of a ``megatron``
    module in ``source``; ``from P import m`` with m a submodule targets ``P.m``."""
    for level, base, names, line in _import_statements(source):
        if level is None:  # import a.b.c
            for name in names:
                if name in modules:
                    yield name, line, None
            continue
        base = _absolute(level, base, package)
        if base not in modules:
            continue
        for name in names:
            submodule = f"{base}.{name}"
            if submodule in modules:
                yield submodule, line, None
            else:
                yield base, line, name


@functools.lru_cache(maxsize=None)
def _import_statements(source: str) -> Tuple[Tuple[object, str, Tuple[str, ...], int], ...]:
    """(level or None for ``import``, module, names, line) of every import statement."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.append((None, "", tuple(a.name for a in node.names), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            names = tuple(a.name for a in node.names)
            found.append((node.level, node.module or "", names, node.lineno))
    return tuple(found)


def _absolute(level: int, module: str, package: str) -> str:
    if not level:
        return module
    parts = package.split(".")
    parts = parts[: len(parts) - level + 1]
    return ".".join(parts + ([module] if module else []))


def _ancestor_packages(target: str, importer: str, modules: Dict[str, Module]) -> List[str]:
    """Packages whose ``__init__`` importing ``target`` runs, minus the importer's own."""
    parts = target.split(".")
    names = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [n for n in names if n in modules and not (importer + ".").startswith(n + ".")]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# ----------------------------------------------------------------------------- the checks


def test_no_import_cycles():
    modules = package_modules()
    edges = import_edges(modules)
    cycles = import_cycles(edges)
    assert not cycles, "import circles (function-level imports count):\n" + "\n\n".join(
        describe_cycle(cycle, edges) for cycle in cycles
    )


def test_no_private_names_imported_across_packages():
    found = [p for p in private_imports(package_modules()) if (p.importer, p.name) not in PENDING]
    assert not found, "private names imported across packages (make them public):\n" + "\n".join(
        f"  {p.importer}:{p.line} imports {p.name} from {p.source}" for p in found
    )


def test_pending_exceptions_still_occur():
    """Each PENDING entry must still be needed; remove it once its change has landed."""
    occurring = {(p.importer, p.name) for p in private_imports(package_modules())}
    obsolete = PENDING - occurring
    assert not obsolete, f"remove these PENDING entries, they no longer occur: {obsolete}"


def test_core_never_imports_training():
    modules = package_modules()
    found = [
        e
        for e in import_edges(modules)
        if e.importer.startswith("megatron.core") and e.target.startswith("megatron.training")
    ]
    assert not found, "megatron.core imports megatron.training:\n" + "\n".join(
        f"  {e.importer}:{e.line} -> {e.target}" for e in found
    )


# ----------------------------------------------------------------------------- negative controls


def _invented(files: Dict[str, str]) -> Dict[str, Module]:
    """A small package tree: ``{"megatron.x.__init__": src, "megatron.x.a": src}``."""
    modules = {}
    for name, source in files.items():
        is_package = name.endswith(".__init__")
        modules[name[: -len(".__init__")] if is_package else name] = Module(source, is_package)
    return modules


def test_a_circle_through_a_function_level_import_is_found():
    modules = _invented(
        {
            "megatron.__init__": "",
            "megatron.core.__init__": "",
            "megatron.core.a": "from megatron.core import b\n",
            "megatron.core.b": "def f():\n    from megatron.core.a import g\n",
        }
    )
    assert import_cycles(import_edges(modules)) == [["megatron.core.a", "megatron.core.b"]]
    modules["megatron.core.b"] = Module("def f():\n    pass\n", False)
    assert import_cycles(import_edges(modules)) == []


def test_a_circle_through_a_package_init_is_found():
    modules = _invented(
        {
            "megatron.__init__": "",
            "megatron.p.__init__": "from megatron.p.x import f\n",
            "megatron.p.x": "def f():\n    import megatron.q.y\n",
            "megatron.q.__init__": "",
            "megatron.q.y": "from megatron.p.z import h\n",  # runs megatron.p's __init__
            "megatron.p.z": "",
        }
    )
    cycles = import_cycles(import_edges(modules))
    assert cycles == [["megatron.p", "megatron.p.x", "megatron.q.y"]]


def test_private_names_across_packages_are_found():
    modules = _invented(
        {
            "megatron.__init__": "",
            "megatron.core.__init__": "",
            "megatron.core.a": "from megatron.core.b import _same_package\n",
            "megatron.core.b": "",
            "megatron.core.sub.__init__": "",
            "megatron.core.sub.c": "from ..b import _other, public, __version__\n",
        }
    )
    found = [(p.importer, p.name) for p in private_imports(modules)]
    assert found == [("megatron.core.sub.c", "_other")]


def test_core_importing_training_is_found():
    modules = _invented(
        {
            "megatron.__init__": "",
            "megatron.core.__init__": "",
            "megatron.core.a": "def f():\n    import megatron.training.t\n",
            "megatron.training.__init__": "",
            "megatron.training.t": "",
        }
    )
    edges = import_edges(modules)
    assert ("megatron.core.a", "megatron.training.t") in {(e.importer, e.target) for e in edges}
