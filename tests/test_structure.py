"""The package's shape holds: layers whose imports point down, no import cycle, stages that do not know their world,
one registry of stages.

The import graph counts every import of the package, those inside functions
too; only ``TYPE_CHECKING`` blocks (types, never run) are left out, and the
lazy public names of ``osdpipe/__init__.py`` (imported on first use, by
name). A cycle fails with the modules in it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import osdpipe

PACKAGE = Path(osdpipe.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports, anywhere in it but under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    # osdpipe/__init__.py imports nothing of the package at import time: its public names are resolved on first use.
    return {name: imported(name, path, known) if name != "osdpipe" else set() for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


#: The layers, lowest first: a module imports only from its own layer and those before it (docs/architecture.md).
LAYERS = ("core", "layout", "io", "spec", "run", "verify", "pipeline", "cli")
#: What sits above every layer, at the package's top: the lazy public names, ``python -m osdpipe`` and the Python API.
TOP = {"osdpipe", "osdpipe.__main__", "osdpipe.api"}


def layer_of(module: str) -> int:
    """The layer's place in :data:`LAYERS` (the top modules: above them all)."""
    if module in TOP:
        return len(LAYERS)
    return LAYERS.index(module.split(".")[1])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above its own, as ``importer -> imported``."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))


def test_the_package_holds_its_layers_and_nothing_loose() -> None:
    found = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert found == {"__init__.py", "__main__.py", "api.py", *LAYERS}
    for layer in LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file(), (
            f"osdpipe/{layer}/ is a package with a docstring that says what the layer is"
        )
    assert {m for m in modules() if m.count(".") == 0 or m.split(".")[1] not in LAYERS} == TOP


def test_every_import_points_down_the_layers() -> None:
    assert upward_imports(import_graph()) == []


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    """Planted in a module's text, inside a function: the check reads the source, as it reads the package's."""
    known = modules()
    planted = tmp_path / "ranges.py"
    planted.write_text(
        known["osdpipe.layout.ranges"].read_text() + "\n\ndef planted():\n    from osdpipe.io.output import commit\n"
    )
    graph = import_graph()
    graph["osdpipe.layout.ranges"] = imported("osdpipe.layout.ranges", planted, known)
    assert upward_imports(graph) == ["osdpipe.layout.ranges -> osdpipe.io.output"]


def test_the_check_catalog_and_the_checks_that_run_are_one_list() -> None:
    from osdpipe.spec import checks
    from osdpipe.verify.checks import RUNS

    assert tuple(RUNS) == checks.names()
    for name, module in RUNS.items():
        assert (
            module.__name__ == f"osdpipe.verify.checks.{name}" and callable(module.run) and callable(module.skip_reason)
        )


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = import_graph()
    # what layout.rank_layout once did
    graph["osdpipe.layout.ranges"] = graph["osdpipe.layout.ranges"] | {"osdpipe.layout.kinds"}
    assert any({"osdpipe.layout.ranges", "osdpipe.layout.kinds"} <= set(c) for c in cycles(graph))


def test_the_cycle_finder_counts_imports_inside_functions(tmp_path: Path) -> None:
    known = {"osdpipe.a": tmp_path / "a.py", "osdpipe.b": tmp_path / "b.py"}
    known["osdpipe.a"].write_text("def f():\n    from osdpipe import b\n")
    known["osdpipe.b"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from osdpipe.a import f\n")
    assert imported("osdpipe.a", known["osdpipe.a"], known) == {"osdpipe.b"}
    assert imported("osdpipe.b", known["osdpipe.b"], known) == set()


def world_questions(source: str) -> list[str]:
    """The code (not the words) in ``source`` that asks which world it runs in."""
    asked = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("offline", "mode", "is_initialized"):
            asked.append(ast.unparse(node))
        if isinstance(node, ast.Name) and node.id in ("SoloWorld", "GroupWorld"):
            asked.append(node.id)
    return asked


def test_no_stage_asks_which_world_it_runs_in() -> None:
    import inspect

    from osdpipe.pipeline.stages import STAGES

    paths = {Path(inspect.getsourcefile(stage)) for stage in STAGES.values()}
    assert len(paths) == len(STAGES)
    for path in paths:
        asked = world_questions(path.read_text())
        assert not asked, f"{path.name} asks {asked}: ask the world what it can do (ctx.world), not which world it is"
    assert world_questions("if ctx.offline:\n    pass\nx = spec.runtime.mode\n") == ["ctx.offline", "spec.runtime.mode"]


def test_the_stage_registry_runs_the_spec_s_stages_in_order() -> None:
    from osdpipe.pipeline.stages import STAGES
    from osdpipe.spec.config import STAGE_ORDER

    assert tuple(STAGES) == STAGE_ORDER


def test_stages_are_functions_of_frozen_products() -> None:
    """Context is the frozen (plan, world, rank); each stage takes (ctx, the previous product, a tally) and returns a
    frozen product."""
    import dataclasses
    import inspect

    from osdpipe.pipeline.stages import STAGES
    from osdpipe.run import products
    from osdpipe.run.context import Context

    assert [f.name for f in dataclasses.fields(Context)] == ["plan", "world", "rank"]
    assert Context.__dataclass_params__.frozen
    made = {
        "load": "Opened",
        "broadcast": "Described",
        "flatten": "Flattened",
        "shard": "Sharded",
        "rekey": "Keyed",
        "verify": "Verified",
        "save": "Staged",
    }
    for name, stage in STAGES.items():
        params = list(inspect.signature(stage).parameters)
        assert len(params) == 3 and params[0] == "ctx" and params[2] == "tally", f"stage {name} takes {params}"
        returned = inspect.signature(stage).return_annotation
        assert returned == made[name], f"stage {name} returns {returned}"
        assert getattr(products, made[name]).__dataclass_params__.frozen
