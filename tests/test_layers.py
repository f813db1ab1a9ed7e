"""Imports inside offload/ flow one way: down the layers of LAYERS, and never in a cycle.

Every module under offload/ is read with ``ast`` (nothing is imported); each
``import offload...`` and ``from offload... import`` is resolved to the module it loads,
those inside functions included: a function-level import is still a dependency, only a
later one. Imports under ``if TYPE_CHECKING:`` are skipped (they never run). Importing
``offload.a.b`` also runs ``offload/a/__init__.py``; that implied edge is not counted, or
every leaf of a package would depend on everything its package re-exports.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Sequence, Set, Tuple

import offload

PACKAGE_DIR = Path(offload.__file__).parent

# Lowest first. A module may import modules of its own layer or of lower ones. A module is
# named by its path ("offload.io.engine"; a package's __init__.py is "offload.io.__init__")
# and belongs to the layer of the longest name here that is it or one of its parents.
LAYERS: List[List[str]] = [
    ["offload._native", "offload._info", "offload._sizes", "offload.errors", "offload.faults"],
    # A leaf: config asks it whether an io_backend can start, without the I/O engine.
    ["offload.io.probe"],
    ["offload.config"],
    # The package face of io re-exports engine, probe and swap, so it sits with them.
    ["offload.units", "offload.io.__init__", "offload.io.engine", "offload.io.swap",
     "offload.io.safetensors", "offload.io.checksum", "offload.stats"],
    ["offload.tiers"],
    # One layer per package from here. ZeRO's shard records and collectives sit below
    # memory: memory.layout keeps each unit's ParamShard and ShardRange (the sharded
    # optimizer step is optim.sharded). The prefetcher imports nothing of memory's; memory's
    # residency drives it. The master codec is memory's (memory.master_codec), below the
    # optimizer that also splits and joins masters.
    ["offload.zero"],
    ["offload.prefetch"],
    ["offload.memory"],
    ["offload.optim"],
    ["offload.checkpoint"],
    ["offload.hooks", "offload.engine"],
    ["offload.plan", "offload.plan_activations", "offload.plan_optimizers", "offload.plan_ranks",
     "offload.plan_shapes", "offload.profile",
     "offload.doctor",
     "offload.gpt", "offload.demo",
     "offload.cli", "offload.__init__", "offload.__main__", "offload.integrations"],
]

# Imports that break the rules today, as (importer, imported). Each is to be removed by the
# issue named beside it; an entry that no longer breaks a rule fails the test, so this list
# only shrinks. Empty today.
KNOWN_VIOLATIONS: FrozenSet[Tuple[str, str]] = frozenset()


def module_names(package_dir: Path) -> Dict[str, Path]:
    """Dotted name of every module of the package, to its file. A compiled module counts
    (by its stub or its .so) but is not parsed."""
    package = package_dir.name
    names: Dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*")):
        if path.suffix not in (".py", ".pyi", ".so") or "__pycache__" in path.parts:
            continue
        relative = path.relative_to(package_dir).parts
        stem = relative[-1].split(".")[0]  # _native.cpython-311-x86_64-linux-gnu.so -> _native
        name = ".".join((package,) + relative[:-1] + (stem,))
        if path.suffix == ".py" or name not in names:
            names[name] = path
    return names


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except those only under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _resolve(dotted: str, modules: Dict[str, Path]) -> str:
    """The module ``dotted`` loads: a package's name means its __init__."""
    if f"{dotted}.__init__" in modules:
        return f"{dotted}.__init__"
    return dotted


def import_graph(package_dir: Path) -> Dict[str, Set[str]]:
    """Module -> the modules of the package it imports (itself excluded)."""
    package = package_dir.name
    modules = module_names(package_dir)
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        if path.suffix != ".py":
            continue
        own_package = name.split(".")[:-1]  # "offload.io.engine" and "offload.io.__init__": io
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: level 1 is this module's package, 2 its parent
                    anchor = own_package[:len(own_package) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    sub = _resolve(submodule, modules)
                    targets.append(submodule if sub in modules else base)
            for target in targets:
                if target != package and not target.startswith(package + "."):
                    continue
                # ``import offload.io.probe`` loads that module; walk up to the longest name
                # that is one (``from offload.x import y`` with y not a module loads offload.x).
                pieces = target.split(".")
                while pieces and _resolve(".".join(pieces), modules) not in modules:
                    pieces.pop()
                resolved = _resolve(".".join(pieces), modules)
                if resolved != name:
                    graph[name].add(resolved)
    return graph


def layer_of(module: str, layers: Sequence[Sequence[str]]) -> int:
    """Index of the layer whose longest name is ``module`` or a parent of it; -1 if none."""
    best, best_length = -1, -1
    for index, names in enumerate(layers):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    return best


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _reaches(graph: Dict[str, Set[str]], start: str, goal: str) -> bool:
    seen, frontier = {start}, [start]
    while frontier:
        for successor in graph.get(frontier.pop(), ()):
            if successor == goal:
                return True
            if successor not in seen:
                seen.add(successor)
                frontier.append(successor)
    return False


def layer_problems(package_dir: Path, layers: Sequence[Sequence[str]],
                   known_violations: FrozenSet[Tuple[str, str]]) -> List[str]:
    """Every break of the rules in the package's imports, as sentences; [] when none."""
    graph = import_graph(package_dir)
    problems = [f"{module} is in no layer of LAYERS: place it there"
                for module in sorted(graph) if layer_of(module, layers) < 0]
    for importer in sorted(graph):
        for imported in sorted(graph[importer]):
            if (importer, imported) in known_violations:
                continue
            low, high = layer_of(importer, layers), layer_of(imported, layers)
            if 0 <= low < high:
                problems.append(f"{importer} (layer {low}) imports {imported} (layer {high}), "
                                "a higher layer")
    allowed_graph = {m: {t for t in targets if (m, t) not in known_violations}
                     for m, targets in graph.items()}
    problems += [f"import cycle: {' <-> '.join(cycle)}" for cycle in _cycles(allowed_graph)]
    for importer, imported in sorted(known_violations):
        upward = layer_of(importer, layers) < layer_of(imported, layers)
        in_cycle = _reaches(graph, imported, importer)
        if imported not in graph.get(importer, ()) or not (upward or in_cycle):
            problems.append(f"KNOWN_VIOLATIONS lists {importer} -> {imported}, which no longer "
                            "breaks a rule: remove it from the list")
    return problems


def test_offload_imports_flow_down_the_layers_without_cycles():
    assert layer_problems(PACKAGE_DIR, LAYERS, KNOWN_VIOLATIONS) == []


def test_the_layers_name_each_module_prefix_once():
    names = [name for layer in LAYERS for name in layer]
    assert len(names) == len(set(names))


def _plant(root: Path, files: Dict[str, str]) -> Path:
    """A package ``offload`` under ``root`` with these files (path -> source)."""
    for relative, source in files.items():
        path = root / "offload" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root / "offload"


SYNTHETIC_LAYERS = [["offload.low"], ["offload.mid", "offload.pkg"], ["offload.high"]]


def test_checker_catches_a_planted_cycle(tmp_path):
    package = _plant(tmp_path, {
        "__init__.py": "",
        "low.py": "",
        "mid.py": "from offload.pkg.inner import thing\n",
        "pkg/__init__.py": "",
        "pkg/inner.py": "def thing():\n    from offload import mid\n",  # function level
        "high.py": "from offload import low, mid\n",
    })
    layers = SYNTHETIC_LAYERS + [["offload.__init__"]]
    assert layer_problems(package, layers, frozenset()) == [
        "import cycle: offload.mid <-> offload.pkg.inner"]


def test_checker_catches_a_planted_upward_import(tmp_path):
    package = _plant(tmp_path, {
        "__init__.py": "",
        "low.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from offload.high import Thing  # never runs: not a dependency
            def f():
                import offload.mid
            """,
        "mid.py": "from . import low\n",
        "high.py": "from offload.low import f\nfrom offload import mid\n",
        "stray.py": "",
    })
    layers = SYNTHETIC_LAYERS + [["offload.__init__"]]
    assert import_graph(package)["offload.low"] == {"offload.mid"}
    assert import_graph(package)["offload.mid"] == {"offload.low"}
    assert layer_problems(package, layers, frozenset()) == [
        "offload.stray is in no layer of LAYERS: place it there",
        "offload.low (layer 0) imports offload.mid (layer 1), a higher layer",
        "import cycle: offload.low <-> offload.mid"]
    # Allowlisting the upward edge silences both the layer break and the cycle it closes.
    layers.append(["offload.stray"])
    assert layer_problems(package, layers, frozenset({("offload.low", "offload.mid")})) == []


def test_checker_fails_on_an_allowlisted_violation_that_is_gone(tmp_path):
    package = _plant(tmp_path, {
        "__init__.py": "",
        "low.py": "",
        "mid.py": "import offload.low\n",
        "high.py": "",
    })
    layers = SYNTHETIC_LAYERS + [["offload.__init__"]]
    assert layer_problems(package, layers, frozenset({("offload.low", "offload.high"),
                                                      ("offload.mid", "offload.low")})) == [
        "KNOWN_VIOLATIONS lists offload.low -> offload.high, which no longer breaks a rule: "
        "remove it from the list",
        "KNOWN_VIOLATIONS lists offload.mid -> offload.low, which no longer breaks a rule: "
        "remove it from the list"]


# ------------------------------------------------------------------ the tests' own imports
TESTS_DIR = Path(__file__).parent


def imported_test_modules(tree: ast.AST) -> Iterator[str]:
    """The names of test modules (``test_*``) that ``tree`` imports, wherever the import is."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # "from . import test_x" names the module in the alias; "from test_x import y" in module
            names = [node.module] if node.module else [alias.name for alias in node.names]
        else:
            continue
        yield from (name for name in names if name.rpartition(".")[2].startswith("test_"))


def test_no_test_module_imports_another():
    """Shared helpers live in tests/support.py; a test module importing another one would run
    that module's import-time setup and tie the two files' helpers together."""
    found = {str(path.relative_to(TESTS_DIR)): sorted(set(imported_test_modules(ast.parse(path.read_text()))))
             for path in sorted(TESTS_DIR.rglob("*.py"))}
    assert {path: names for path, names in found.items() if names} == {}
