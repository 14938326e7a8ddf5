"""The house's import graph, read from the source (every import, those inside functions and under
``if TYPE_CHECKING`` too: a type's import ties two modules as any other does): no circle between modules, none between the wings of
``cluster/``, and the engine is the floor — it imports nothing of Tandem's outside itself
but ``cluster/paths.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "router", "prefill_worker", "decode_worker", "tandem")
GENERATED = ("tandem.v1.",)
ENGINE_MAY_IMPORT = ("cluster.engine", "cluster.paths")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = _module_name(path)
            if not name.startswith(GENERATED):
                found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of this tree that ``name`` imports (``from a import b``: ``a.b`` when that is
    a module, else ``a``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _wing(module: str) -> str:
    """``cluster.<wing>`` for a module of a folder in cluster/, the top-level package otherwise
    (a loose module of cluster/ is a wing of its own)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "cluster" and len(parts) > 1 else parts[0]


def test_the_reader_finds_imports_of_every_kind():
    graph = _graph()
    assert "cluster.engine.scheduler" in graph["cluster.engine.engine"]  # from a import b.c
    assert "cluster.kv_transfer.transports" in graph["cluster.kv_transfer.agent"]
    assert "cluster.engine.models.gguf_checkpoint" in graph["cluster.engine.models.read_config"]
    # an import inside a function counts
    assert "cluster.default_model" in graph["cluster.offline.llm"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_round_a_circle():
    assert _circles(_graph()) == []


def test_no_circle_between_the_wings():
    wings: dict[str, set[str]] = {}
    for module, imported in _graph().items():
        wings.setdefault(_wing(module), set()).update(_wing(m) for m in imported if _wing(m) != _wing(module))
    assert _circles(wings) == []


def test_the_engine_is_the_floor():
    upward = {
        module: sorted(m for m in imported if not m.startswith(ENGINE_MAY_IMPORT))
        for module, imported in _graph().items() if module.startswith("cluster.engine")
    }
    assert {module: names for module, names in upward.items() if names} == {}
