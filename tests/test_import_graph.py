"""No import cycles in the package: the graph of top-level imports (read from the source, not by
importing) must be acyclic, so must the graph of the folders it makes (each subpackage, the
mapped ``calibrators`` / ``cli`` / ``evals`` included, and each top-level module, one node: the
folders form layers: docs/design.md's table gives each its layer, and every import across
folders points to a lower one), no fp8ptq module imports another inside a
function (the way cycles used to be dodged), and no module is over 450 lines."""

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_modules() -> dict[str, Path]:
    """Every module of the wheel, by dotted name, from pyproject's package-dir mapping."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = config.get("package-dir", {})
    out = {}
    for package in config["packages"]:
        base = dirs.get(package)
        if base is None:  # a sub-folder of a mapped parent
            parent, _, leaf = package.rpartition(".")
            base = str(Path(dirs.get(parent, parent.replace(".", "/"))) / leaf)
        for path in sorted((ROOT / base).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


def _is_package(name: str, modules) -> bool:
    return modules[name].stem == "__init__"


def _resolve(importer: str, level: int, module: str | None, modules) -> str:
    if level == 0:
        return module or ""
    base = importer if _is_package(importer, modules) else importer.rpartition(".")[0]
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{module}" if module else base


def _known(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _top_level(tree):
    """Import statements executed at import time (module body, also inside top-level
    if/try blocks, but not under ``if TYPE_CHECKING``), and those inside functions."""
    top, local = [], []

    def walk(nodes, in_function):
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                (local if in_function else top).append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(node.body, True)
            elif isinstance(node, ast.ClassDef):
                walk(node.body, in_function)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        walk(child.body if isinstance(child, ast.ExceptHandler) else [child],
                             in_function)

    walk(tree.body, False)
    return top, local


def _targets(importer: str, node, modules) -> set[str]:
    out = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            out.add(_known(alias.name, modules))
    else:
        base = _resolve(importer, node.level, node.module, modules)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.add(sub if sub in modules else _known(base, modules))
    return {t for t in out if t is not None and t != importer}


def import_graph(local: bool = False) -> dict[str, set[str]]:
    modules = package_modules()
    graph = {}
    for name, path in modules.items():
        top, inner = _top_level(ast.parse(path.read_text(), str(path)))
        graph[name] = set().union(*[_targets(name, n, modules) for n in (inner if local else top)])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def folder(module: str, modules) -> str:
    """The node of ``module`` in the folder graph: its subpackage of ``fp8ptq`` (``fp8ptq.io``,
    ``fp8ptq.cli``), or the module itself where it sits at the top (``fp8ptq.errors``)."""
    top = ".".join(module.split(".")[:2])
    return top if top != module or _is_package(top, modules) else module


def folder_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Which folder imports which: an edge for every module-level import across folders."""
    modules = package_modules()
    out: dict[str, set[str]] = {}
    for name, targets in (import_graph() if graph is None else graph).items():
        here = folder(name, modules)
        out.setdefault(here, set()).update(
            t for t in (folder(t, modules) for t in targets) if t != here)
    return out


def test_the_graph_sees_every_module_and_its_imports():
    graph = import_graph()
    assert {"fp8ptq.config.plan", "fp8ptq.calibrators.registry", "fp8ptq.cli.eval_cmd",
            "fp8ptq.evals.compare", "fp8ptq.model.forward"} <= set(graph)
    assert "fp8ptq.config.plan" in graph["fp8ptq.execution.in_memory"]
    assert "fp8ptq.model.forward" in graph["fp8ptq.calibrators.layerwise"]


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_package():
    assert cycles(import_graph()) == []


def test_folders_are_nodes_of_the_folder_graph():
    graph = folder_graph()
    assert {"fp8ptq.io", "fp8ptq.calibrators", "fp8ptq.cli", "fp8ptq.evals", "fp8ptq.errors",
            "fp8ptq.algorithms"} <= set(graph)
    assert "fp8ptq.algorithms.gptq" not in graph  # a sub-folder belongs to its folder
    assert "fp8ptq.formats" in graph["fp8ptq.calibrators"]


def test_folder_graph_finds_a_cycle_through_two_modules_of_each_folder():
    """Acyclic modules can still make cyclic folders: a.x -> b.y and b.z -> a.w."""
    modules = {"fp8ptq.model.x": {"fp8ptq.io.y"}, "fp8ptq.io.z": {"fp8ptq.model.w"},
               "fp8ptq.model.w": set(), "fp8ptq.io.y": set()}
    assert cycles(modules) == []
    assert cycles(folder_graph(modules)) == [["fp8ptq.io", "fp8ptq.model"]]


def test_no_import_cycles_between_folders():
    """Folders form layers: a folder imports only folders below it (docs/design.md)."""
    assert cycles(folder_graph()) == []


def design_layers() -> dict[str, int]:
    """Folder -> layer, from the folder table of docs/design.md (``| 3 | `fp8ptq/nn/` | ...``)."""
    rows = re.findall(r"^\| (\d+) \| `([\w/]+)/` \|", (ROOT / "docs" / "design.md").read_text(),
                      re.MULTILINE)
    return {"fp8ptq." + path.removeprefix("fp8ptq/").replace("/", "."): int(layer)
            for layer, path in rows}


def test_the_design_doc_draws_the_layers_the_imports_keep():
    """Every folder is in docs/design.md's table, and imports only folders of lower layers."""
    layers, graph = design_layers(), folder_graph()
    folders = {f for f in graph if _is_package(f, package_modules()) and f != "fp8ptq"}
    assert folders == set(layers)
    upward = sorted(f"{a} ({layers[a]}) -> {b} ({layers[b]})" for a in folders
                    for b in graph[a] if b in layers and layers[b] >= layers[a])
    assert upward == []


def test_no_module_over_450_lines():
    """A module that grows is split by job (docs/design.md)."""
    long = {name: n for name, path in package_modules().items()
            if (n := len(path.read_text().splitlines())) > 450}
    assert long == {}


def test_no_function_local_imports_of_package_modules():
    """Imports inside functions were how cycles were dodged; optional third-party imports
    inside functions stay allowed."""
    local = {m: sorted(t) for m, t in import_graph(local=True).items() if t}
    assert local == {}
