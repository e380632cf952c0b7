"""Dependencies point downward: cluster -> scheduler -> worker -> kernels."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagefleet"
LAYERS = ["kernels", "worker", "scheduler", "cluster"]  # each may import only those before it


def imported_pagefleet_layers(path: Path) -> set[str]:
    layers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "pagefleet" and len(parts) > 1 and parts[1] in LAYERS:
                layers.add(parts[1])
    return layers


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(imported_pagefleet_layers(path) - allowed)
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        if imported_pagefleet_layers(path) - allowed
    }
    assert not offenders, f"{layer} imports layers above it: {offenders}"


def test_only_the_actor_modules_import_ray() -> None:
    importers = sorted(
        str(path.relative_to(PACKAGE))
        for layer in ("kernels", "worker", "scheduler")
        for path in (PACKAGE / layer).rglob("*.py")
        if any(
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "ray" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "ray")
            for n in ast.walk(ast.parse(path.read_text()))
        )
    )
    assert importers == ["scheduler/actor.py", "worker/actor.py"]


FRONTS = ("grpc_server", "openai", "dashboard", "drain")


def _cluster_imports(front: str) -> set[str]:
    """The cluster modules a front (a module, or a package's modules together) imports,
    its own package left out."""
    package = PACKAGE / "cluster" / front
    paths = sorted(package.glob("*.py")) if package.is_dir() else [package.with_suffix(".py")]
    return {
        node.module.split(".")[2]
        for path in paths
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.startswith("pagefleet.cluster.")
    } - {front}


@pytest.mark.parametrize("front", FRONTS)
def test_a_front_sees_the_ingress_only_through_the_shared_api(front: str) -> None:
    imports = _cluster_imports(front)
    assert "api" in imports
    assert "ingress" not in imports
    # Neither wire protocol depends on the other.
    assert not imports & ({"grpc_server", "openai"} - {front})


def _cluster_import_graph() -> dict[str, set[str]]:
    """cluster module -> the cluster modules it imports, at the top or inside a function."""
    graph: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "cluster").glob("*.py")):
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            imported |= {n.split(".")[2] for n in names if n.startswith("pagefleet.cluster.")}
        graph[path.stem] = imported - {path.stem}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (as a path that ends where it starts), or []."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        for imported in sorted(graph.get(module, ())):
            if found := visit(imported, [*path, module]):
                return found
        done.add(module)
        return []

    for module in sorted(graph):
        if found := visit(module, []):
            return found
    return []


def test_cluster_modules_import_each_other_without_a_cycle() -> None:
    # Deferred imports count too: an import moved into a function still ties the modules.
    cycle = _cycle(_cluster_import_graph())
    assert not cycle, f"import cycle in cluster/: {' -> '.join(cycle)}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_the_processes_that_only_start_or_call_workers_do_not_load_torch() -> None:
    """The driver, the membership and scheduler actors and the ingress import these modules;
    torch (about 1.5 CPU-seconds) loads only in a worker's own process, when its engine is
    built. A fresh interpreter, since this one has torch loaded already."""
    import subprocess
    import sys

    modules = [
        "pagefleet.cluster.app",
        "pagefleet.cluster.membership",
        "pagefleet.cluster.serve_app",
        "pagefleet.cluster.ingress",
        "pagefleet.scheduler.actor",
        "pagefleet.worker.actor",
    ]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
