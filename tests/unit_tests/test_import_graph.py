"""The package's import graph (SPEC section 9): no circles, no private names across packages,
``megatron.core`` never imports ``megatron.training``, imports run one way down the layers of
docs/architecture.md (``LAYERS``, data here), and ``torch.distributed`` collectives anywhere
in ``megatron`` (the core and the trainer) are called from ``megatron.core.communication``
only (plus a short allow-list, each entry with its reason).

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


# The layers of docs/architecture.md, bottom to top: a module may import its own layer and the
# ones below. A module belongs to the layer of the longest name that is it or a package above
# it (``megatron.core.transformer.transformer_config`` sits below the rest of its package).
LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    (
        "rules",
        (
            "megatron.core.config_rules",
            "megatron.core.moe_config_rules",
            "megatron.core.config",
            "megatron.core.enums",
            "megatron.core.fp8.config",
        ),
    ),
    (
        "device, groups",
        (
            "megatron.core.device",
            "megatron.core.parallel_state",
            "megatron.core.process_groups_config",
            "megatron.core.hyper_comm_grid",
            "megatron.core.model_parallel_config",
            "megatron.core.jit",
            "megatron.core.packed_seq_params",
        ),
    ),
    ("communication", ("megatron.core.communication",)),
    ("checkpoint format", ("megatron.core.dist_checkpointing",)),
    (
        "parallel regions",
        (
            "megatron.core.tensor_parallel",
            "megatron.core.context_parallel",
            "megatron.core.utils",
            "megatron.core.fp8",
        ),
    ),
    ("fusions", ("megatron.core.fusions", "megatron.core.rope")),
    (
        "transformer config",
        ("megatron.core.transformer.transformer_config", "megatron.core.transformer.enums"),
    ),
    ("transformer", ("megatron.core.transformer",)),
    ("inference", ("megatron.core.inference",)),
    ("models", ("megatron.core.models",)),
    (
        "training machinery",
        (
            "megatron.core.pipeline_parallel",
            "megatron.core.distributed",
            "megatron.core.optimizer",
            "megatron.core.optimizer_param_scheduler",
        ),
    ),
    ("data, tokenizers", ("megatron.core.datasets", "megatron.core.tokenizers")),
    (
        "drop-in names",
        ("megatron.core", "megatron.core.extensions", "megatron.core.inference_params"),
    ),
    ("trainer", ("megatron", "megatron.training")),
)

# torch.distributed functions that communicate: outside megatron.core.communication they may
# appear (called or referenced) only where RAW_COLLECTIVES_ALLOWED says why.
COLLECTIVES = frozenset(
    """all_reduce all_reduce_coalesced all_gather all_gather_into_tensor all_gather_object
    all_gather_coalesced _all_gather_base reduce_scatter reduce_scatter_tensor
    _reduce_scatter_base all_to_all all_to_all_single broadcast broadcast_object_list reduce
    send recv isend irecv batch_isend_irecv P2POp gather gather_object scatter
    scatter_object_list barrier monitored_barrier send_object_list recv_object_list""".split()
)
CALL_ONLY = frozenset({"P2POp"})  # a class: counts when constructed, not in annotations
COMMUNICATION_MODULE = "megatron.core.communication"
# (module, function name): why the raw call is better where it is
RAW_COLLECTIVES_ALLOWED: Dict[Tuple[str, str], str] = {}


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


class RawCollective(NamedTuple):
    module: str
    line: int
    name: str


def raw_collectives(modules: Dict[str, Module]) -> List[RawCollective]:
    """Uses of a ``torch.distributed`` collective (``COLLECTIVES``) in ``megatron`` (the core
    and the trainer) outside ``communication``: ``dist.all_reduce`` through any alias of the module
    (``import torch.distributed as dist``, ``torch.distributed.x``, ``from torch import
    distributed``), or the function imported by name (``from torch.distributed import x``),
    called or only referenced."""
    found = []
    for name, (source, _) in modules.items():
        if name == COMMUNICATION_MODULE:
            continue
        found += [RawCollective(name, line, what) for line, what in _raw_collectives(source)]
    return found


@functools.lru_cache(maxsize=None)
def _raw_collectives(source: str) -> Tuple[Tuple[int, str], ...]:
    """(line, collective) of every raw collective in one module's source (see
    ``raw_collectives``); cached, as the package's modules are read by several tests."""
    found = []
    tree = _tree(source)
    module_aliases, function_aliases = _distributed_aliases(tree)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in CALL_ONLY and id(node) not in called:
            continue  # a type annotation, not a message
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            if _dotted(node.value) in module_aliases:
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in function_aliases:
            found.append((node.lineno, function_aliases[node.id]))
        elif isinstance(node, ast.ImportFrom) and node.module in _DISTRIBUTED_MODULES:
            for alias in node.names:
                if alias.name in COLLECTIVES:
                    found.append((node.lineno, alias.name))
    return tuple(found)


@functools.lru_cache(maxsize=None)
def _tree(source: str) -> ast.AST:
    """One parse per module source (shared by the tests; the trees are only read)."""
    return ast.parse(source)


_DISTRIBUTED_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")


def _distributed_aliases(tree: ast.AST) -> Tuple[Set[str], Dict[str, str]]:
    """(dotted names bound to torch.distributed, {local name: collective it is bound to})."""
    modules = set(_DISTRIBUTED_MODULES)
    functions: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in _DISTRIBUTED_MODULES and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in _DISTRIBUTED_MODULES:
                    modules.add(alias.asname or alias.name)
                elif node.module in _DISTRIBUTED_MODULES and alias.name in COLLECTIVES:
                    functions[alias.asname or alias.name] = alias.name
    return modules, functions


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a chain of attributes on a name, else ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id] + parts[::-1])


class UpwardImport(NamedTuple):
    edge: Edge
    importer_layer: str
    target_layer: str


def layer_of(module: str, layers=LAYERS) -> int:
    """Index in ``layers`` of ``module``'s layer (longest matching name), -1 for none."""
    best, best_length = -1, -1
    for index, (_, names) in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_length:
                best, best_length = index, len(name)
    return best


def upward_imports(edges: List[Edge], layers=LAYERS) -> List[UpwardImport]:
    """Edges whose target sits in a higher layer than their importer."""
    found = []
    for edge in edges:
        low, high = layer_of(edge.importer, layers), layer_of(edge.target, layers)
        if low >= 0 and high > low:
            found.append(UpwardImport(edge, layers[low][0], layers[high][0]))
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
    for node in ast.walk(_tree(source)):
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


def test_every_module_has_a_layer():
    modules = package_modules()
    missing = sorted(m for m in modules if layer_of(m) < 0)
    assert (
        not missing
    ), f"modules in no layer (add them to LAYERS and docs/architecture.md): {missing}"


def test_imports_run_down_the_layers():
    """No module imports a module of a higher layer (docs/architecture.md, ``LAYERS``)."""
    found = upward_imports(import_edges(package_modules()))
    assert not found, "upward imports (move the shared part down a layer):\n" + "\n".join(
        f"  {u.edge.importer}:{u.edge.line} ({u.importer_layer}) -> {u.edge.target} "
        f"({u.target_layer})"
        for u in found
    )


def test_collectives_only_in_communication():
    """Every torch.distributed collective of megatron (the core and the trainer) goes through
    communication.py (its gloo/NCCL, device and async-handle choices are made there once)."""
    found = [
        c
        for c in raw_collectives(package_modules())
        if (c.module, c.name) not in RAW_COLLECTIVES_ALLOWED
    ]
    assert not found, (
        "torch.distributed collectives outside megatron.core.communication (add a function "
        "there, or an allow-list entry with its reason):\n"
        + "\n".join(f"  {c.module}:{c.line} {c.name}" for c in found)
    )


def test_collective_allow_list_entries_still_occur():
    """Each RAW_COLLECTIVES_ALLOWED entry must still be needed."""
    occurring = {(c.module, c.name) for c in raw_collectives(package_modules())}
    obsolete = set(RAW_COLLECTIVES_ALLOWED) - occurring
    assert not obsolete, f"remove these RAW_COLLECTIVES_ALLOWED entries: {obsolete}"


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


def test_a_planted_raw_collective_is_found():
    """Each way of reaching a collective is caught, in the core and in the trainer;
    communication.py is not checked; a non-collective torch.distributed function is not
    flagged."""
    modules = _invented(
        {
            "megatron.__init__": "",
            "megatron.core.__init__": "",
            "megatron.core.communication": "import torch.distributed as dist\n"
            "def f(t):\n    dist.all_reduce(t)\n",
            "megatron.core.a": "import torch.distributed as dist\n"
            "def f(t, g):\n    dist.all_reduce(t, group=g)\n    return dist.get_rank(g)\n",
            "megatron.core.b": "import torch\n"
            "def f(t):\n    torch.distributed.broadcast(t, 0)\n",
            "megatron.core.c": "from torch.distributed import all_to_all_single as a2a\n",
            "megatron.core.d": "from torch import distributed as td\n"
            "def f(ops):\n    return td.batch_isend_irecv(ops)\n",
            "megatron.core.e": "import torch.distributed as dist\n"
            "def f(t, peer) -> dist.P2POp:\n    return dist.P2POp(dist.isend, t, peer)\n",
            "megatron.training.t": "import torch.distributed as dist\n"
            "def f():\n    dist.barrier()\n",
        }
    )
    found = sorted((c.module, c.name) for c in raw_collectives(modules))
    assert found == [
        ("megatron.core.a", "all_reduce"),
        ("megatron.core.b", "broadcast"),
        ("megatron.core.c", "all_to_all_single"),
        ("megatron.core.d", "batch_isend_irecv"),
        ("megatron.core.e", "P2POp"),
        ("megatron.core.e", "isend"),
        ("megatron.training.t", "barrier"),
    ]


def test_an_upward_import_is_found():
    """On an invented graph: a function-level import of a higher layer is caught (through a
    package's ``__init__`` too), one of the same or a lower layer is not, and a module below
    the rest of its package (``pkg.config``) may not import its package's upper modules."""
    layers = (
        ("low", ("megatron.low", "megatron.pkg.config")),
        ("mid", ("megatron.pkg",)),
        ("high", ("megatron", "megatron.high")),
    )
    modules = _invented(
        {
            "megatron.__init__": "",
            "megatron.low.__init__": "",
            "megatron.low.a": "def f():\n    from megatron.pkg.layer import g\n",
            "megatron.pkg.__init__": "",
            "megatron.pkg.config": "from megatron.pkg import layer\n",
            "megatron.pkg.layer": "from megatron.low import a\nfrom megatron.pkg import config\n",
            "megatron.high.__init__": "",
            "megatron.high.h": "import megatron.pkg.layer\nimport megatron.low.a\n",
        }
    )
    found = {
        (u.edge.importer, u.edge.target) for u in upward_imports(import_edges(modules), layers)
    }
    assert found == {
        ("megatron.low.a", "megatron.pkg.layer"),
        ("megatron.low.a", "megatron.pkg"),
        ("megatron.pkg.config", "megatron.pkg.layer"),
    }
    assert layer_of("megatron.pkg.config.x", layers) == 0 and layer_of("elsewhere", layers) == -1
