"""Package boundaries: which layer may import which, read from the source with `ast` (issue 40).

    common (src/kvpilot: kvpilot.common.* and kvpilot's top-level modules)
      <- kernels <- engine (kvpilot.daemon.engine) <- daemon (the rest of kvpilot.daemon)
      <- router
      <- operator
    cli (kvpilot.cli, kvpilot.__main__: the `kvpilot` script) sits above them all.

Every import counts, at any depth: module level, inside functions (lazy ones), under TYPE_CHECKING,
relative ones resolved to absolute names, and `importlib.import_module` with a literal name. The engine
reaches the kernels only through their entry module, kvpilot.kernels.ops. The daemon, the router and the
operator never import each other; only the cli may import several of them. Within the daemon layer no
two modules import each other, however indirectly (protocol <-> tools once did).
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COMMON, KERNELS, ENGINE, DAEMON, ROUTER, OPERATOR, CLI = "common", "kernels", "engine", "daemon", "router", "operator", "cli"
CLI_MODULES = {"kvpilot.cli", "kvpilot.__main__"}
KERNELS_ENTRY = "kvpilot.kernels.ops"

# layer -> the layers it may import (itself included)
ALLOWED: dict[str, set[str]] = {
    COMMON: {COMMON},
    KERNELS: {COMMON, KERNELS},
    ENGINE: {COMMON, KERNELS, ENGINE},  # kernels: KERNELS_ENTRY only
    DAEMON: {COMMON, ENGINE, DAEMON},  # the kernels are the engine's business
    ROUTER: {COMMON, ROUTER},
    OPERATOR: {COMMON, OPERATOR},
    CLI: {COMMON, DAEMON, ROUTER, OPERATOR, CLI},
}
# layers whose modules must not import each other in a circle
ACYCLIC_LAYERS = (COMMON, DAEMON, ROUTER)


@dataclass(frozen=True)
class Edge:
    importer: str  # module name
    imported: str  # module name (the deepest first-party module the statement names)
    path: Path
    line: int

    def where(self) -> str:
        rel = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{rel}:{self.line}: {self.importer} imports {self.imported} ({layer(self.importer)} -> {layer(self.imported)})"


def layer(module: str) -> str:
    if module in CLI_MODULES:
        return CLI
    for prefix, name in (("kvpilot.daemon.engine", ENGINE), ("kvpilot.daemon", DAEMON), ("kvpilot.kernels", KERNELS),
                         ("kvpilot.router", ROUTER), ("kvpilot.operator", OPERATOR)):
        if module == prefix or module.startswith(prefix + "."):
            return name
    return COMMON  # kvpilot itself, kvpilot.common.*, kvpilot.paths, kvpilot.version, ...


def package_roots() -> dict[str, Path]:
    """Package name -> folder, from pyproject.toml's package-dir (kvpilot -> src/kvpilot, ...)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in pyproject["tool"]["setuptools"]["package-dir"].items()}


def source_modules(roots: dict[str, Path]) -> dict[str, Path]:
    """Every first-party module name -> its file. A folder mapped to its own package (daemon/ under
    kvpilot.daemon) is named from that mapping, never as a child of another root."""
    mapped = set(roots.values())
    out: dict[str, Path] = {}
    for pkg, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if "__pycache__" in rel.parts or any(p in mapped for p in path.parents if p != folder and folder in p.parents):
                continue
            parts = [*pkg.split("."), *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(base: str | None, level: int, package: str) -> str:
    """An import's absolute name: `from ..x import y` in package a.b.c is a.b.x."""
    if level == 0:
        return base or ""
    parts = package.split(".")
    anchor = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join([*anchor, base] if base else anchor)


def _first_party(name: str) -> bool:
    return name == "kvpilot" or name.startswith("kvpilot.")


def imports_of(module: str, path: Path, source: str, known: set[str]) -> Iterator[Edge]:
    """Every first-party import in `source` (the text of `module` at `path`), at any depth."""
    package = _package_of(module, path)
    for node in ast.walk(ast.parse(source, filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, package)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == "import_module"):
            target = node.args[0].value
            dots = len(target) - len(target.lstrip("."))
            # import_module(".x", __name__) in a package's __init__ is relative to that package
            names = [_resolve(target[dots:] or None, dots, module if path.name == "__init__.py" else package)]
        for name in names:
            if _first_party(name):
                yield Edge(module, name, path, node.lineno)


def all_edges(modules: dict[str, Path]) -> list[Edge]:
    known = set(modules)
    return [e for m, p in modules.items() for e in imports_of(m, p, p.read_text(encoding="utf-8"), known)]


def direction_violations(edges: Iterable[Edge]) -> list[str]:
    bad = []
    for e in edges:
        src, dst = layer(e.importer), layer(e.imported)
        if dst not in ALLOWED[src]:
            bad.append(e.where())
        elif src == ENGINE and dst == KERNELS and e.imported != KERNELS_ENTRY:
            bad.append(f"{e.where()}: the engine imports the kernels only through {KERNELS_ENTRY}")
    return bad


def _parents(module: str) -> Iterator[str]:
    parts = module.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def layer_graph(edges: Iterable[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        src, dst = layer(e.importer), layer(e.imported)
        if src != dst:
            graph.setdefault(src, set()).add(dst)
    return graph


def module_graph(edges: Iterable[Edge], within: str, known: set[str]) -> dict[str, set[str]]:
    """Imports between the modules of one layer. Importing a.b.c runs a.b's __init__ too, so that counts,
    except from inside a.b (its __init__ is already running then, as for any submodule)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if layer(e.importer) != within:
            continue
        own = set(_parents(e.importer))
        targets = [p for p in _parents(e.imported) if p not in own] + [e.imported]
        for target in targets:
            if target != e.importer and target in known and layer(target) == within:
                graph.setdefault(e.importer, set()).add(target)
    return graph


def _explain_cycle(cycle: list[str], edges: list[Edge]) -> str:
    lines = []
    for a, b in zip(cycle, cycle[1:], strict=False):
        via = [e for e in edges if e.importer == a and (e.imported == b or b in _parents(e.imported))]
        lines.append(via[0].where() if via else f"{a} -> {b}")
    return "\n  ".join(lines)


# ----------------------------------------------------------------------------- the repository


def _repo() -> tuple[dict[str, Path], list[Edge]]:
    modules = source_modules(package_roots())
    return modules, all_edges(modules)


def test_every_package_folder_is_scanned() -> None:
    modules, edges = _repo()
    layers = {layer(m) for m in modules}
    assert layers == set(ALLOWED), layers
    for expected in ("kvpilot.common.protocol", "kvpilot.cli", "kvpilot.daemon.protocol", "kvpilot.daemon.engine.loader",
                     "kvpilot.kernels.ops", "kvpilot.router.prompt", "kvpilot.operator.scrape"):
        assert expected in modules, expected
    assert len(edges) > 100  # the scan does see the imports


def test_layers_import_only_in_the_agreed_directions() -> None:
    _, edges = _repo()
    bad = direction_violations(edges)
    assert not bad, "imports against the layer directions:\n  " + "\n  ".join(bad)


def test_no_cycle_between_layers() -> None:
    _, edges = _repo()
    cycle = find_cycle(layer_graph(edges))
    assert cycle is None, "layers import each other in a circle: " + " -> ".join(cycle or [])


def test_no_import_cycle_between_modules_of_a_layer() -> None:
    modules, edges = _repo()
    for name in ACYCLIC_LAYERS:
        cycle = find_cycle(module_graph(edges, name, set(modules)))
        assert cycle is None, f"{name} modules import each other in a circle:\n  " + _explain_cycle(cycle or [], edges)


# ----------------------------------------------------------------------------- the checker itself


def _edges_of(module: str, filename: str, source: str, extra_known: Iterable[str] = ()) -> list[Edge]:
    modules, _ = _repo()
    known = set(modules) | set(extra_known)
    return list(imports_of(module, ROOT / filename, source, known))


def test_lazy_relative_and_dynamic_imports_are_seen() -> None:
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..daemon import protocol\n"
        "def f():\n    from .cli import main\n    import kvpilot.operator.scrape\n"
        "    importlib.import_module('kvpilot.daemon.server')\n"
    )
    edges = _edges_of("kvpilot.router.prompt", "router/prompt.py", src)
    assert {e.imported for e in edges} == {"kvpilot.daemon.protocol", "kvpilot.router.cli", "kvpilot.operator.scrape",
                                           "kvpilot.daemon.server"}
    assert len(direction_violations(edges)) == 3  # daemon twice, operator once; its own cli is fine


def test_a_bad_import_is_reported_with_its_file_and_line() -> None:
    edges = _edges_of("kvpilot.common.protocol", "src/kvpilot/common/protocol.py",
                      "import json\n\n\ndef f():\n    from kvpilot.daemon.engine import sampling_params\n")
    (bad,) = direction_violations(edges)
    assert bad == ("src/kvpilot/common/protocol.py:5: kvpilot.common.protocol imports "
                   "kvpilot.daemon.engine.sampling_params (common -> engine)")


def test_the_engine_reaches_the_kernels_only_through_ops() -> None:
    ok = _edges_of("kvpilot.daemon.engine.runner", "daemon/engine/runner.py", "from kvpilot.kernels import ops\n")
    assert direction_violations(ok) == []
    bad = _edges_of("kvpilot.daemon.engine.runner", "daemon/engine/runner.py",
                    "from kvpilot.kernels import cpu_native\nfrom kvpilot.kernels.triton_kernels import x\n")
    assert len(direction_violations(bad)) == 2
    daemon = _edges_of("kvpilot.daemon.serving", "daemon/serving.py", "from kvpilot.kernels import ops\n")
    assert len(direction_violations(daemon)) == 1  # the daemon goes through the engine


def test_only_the_cli_imports_several_components() -> None:
    src = "from kvpilot.daemon.cli import main\nfrom kvpilot.router.cli import main\nimport kvpilot.operator.__main__\n"
    assert direction_violations(_edges_of("kvpilot.cli", "src/kvpilot/cli.py", src)) == []
    assert len(direction_violations(_edges_of("kvpilot.daemon.cli", "daemon/cli.py", src))) == 2


def test_cycles_are_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None
    # protocol -> tools (its package __init__ runs too) and tools.chat_format -> protocol would be one
    known = {"kvpilot.daemon", "kvpilot.daemon.protocol", "kvpilot.daemon.tools", "kvpilot.daemon.tools.chat_format"}
    edges = [Edge("kvpilot.daemon.protocol", "kvpilot.daemon.tools.schema", ROOT / "daemon/protocol.py", 1),
             Edge("kvpilot.daemon.tools", "kvpilot.daemon.tools.chat_format", ROOT / "daemon/tools/__init__.py", 1),
             Edge("kvpilot.daemon.tools.chat_format", "kvpilot.daemon.protocol", ROOT / "daemon/tools/chat_format.py", 1)]
    cycle = find_cycle(module_graph(edges, DAEMON, known))
    assert cycle is not None and "kvpilot.daemon.protocol" in cycle
