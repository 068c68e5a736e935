"""The layout shows the flow: floors never import the stages built on them (design/trainer.md)."""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tfdp")

# The floors, in the order a run goes through them: each may import only lower floors,
# `accounting` (pure Python over dp_accounting) and the leaves.
FLOORS = ["data", "augment", "models", "dp", "training", "export", "audit"]
# `cluster` is a leaf: the multi-worker start-up that `training.make_strategy` runs first.
LEAVES = {"storage", "host", "gin_bindings", "graph_checks", "lease", "workdir", "accounting",
          "process_settings", "atomic_file", "cluster"}
# Leaves of pure Python that import no other part of tfdp: `accounting` may use them.
PURE_LEAVES = {"atomic_file"}
# The stages of the trainer, built on the floors (and the CLI over them).
STAGES = {"configs", "planning", "inputs", "features", "modes", "run", "resume_rule",
          "experiment", "private_training", "main"}


def _imports():
    """{(importing part, imported part)} over tfdp's modules: a part is a folder or a module."""
    edges = set()
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT).split(os.sep)
            source = parts[0] if len(parts) > 1 else parts[0][:-3]
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfdp"):
                    targets = ([a.name for a in node.names] if node.module == "tfdp"
                               else [node.module.split(".")[1]])
                elif isinstance(node, ast.Import):
                    targets = [a.name.split(".")[1] for a in node.names
                               if a.name.startswith("tfdp.")]
                else:
                    continue
                edges |= {(source, target) for target in targets if target != source}
    return edges


def test_every_part_is_a_floor_a_leaf_or_a_stage():
    parts = {p for edge in _imports() for p in edge} - {"__init__"}
    assert parts <= set(FLOORS) | LEAVES | STAGES, parts - set(FLOORS) - LEAVES - STAGES


def test_floors_import_only_lower_floors_and_leaves():
    wrong = []
    for source, target in _imports():
        if source in FLOORS:
            if target in STAGES or (target in FLOORS
                                    and FLOORS.index(target) > FLOORS.index(source)):
                wrong.append(f"tfdp/{source} imports tfdp/{target}")
    assert not wrong, wrong


def test_nothing_imports_the_trainer_but_the_cli():
    users = {source for source, target in _imports() if target == "experiment"}
    assert users <= {"main"}, users


def _imported_names(path):
    """Every module name `path` imports (`from tfdp import x` gives `tfdp.x`)."""
    names = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += ([f"tfdp.{a.name}" for a in node.names] if node.module == "tfdp"
                      else [node.module or ""])
    return names


def test_accounting_imports_no_tensorflow_and_no_other_part_but_pure_leaves():
    allowed = ("tfdp.accounting",) + tuple(f"tfdp.{leaf}" for leaf in PURE_LEAVES)
    for folder, _, files in os.walk(os.path.join(ROOT, "accounting")):
        for name in (n for n in files if n.endswith(".py")):
            for imported in _imported_names(os.path.join(folder, name)):
                assert not imported.startswith(("tensorflow", "keras")), (name, imported)
                assert not imported.startswith("tfdp.") or imported.startswith(
                    allowed), (name, imported)


def test_pure_leaves_import_no_tensorflow_and_no_part_of_tfdp():
    for leaf in PURE_LEAVES:
        for imported in _imported_names(os.path.join(ROOT, leaf + ".py")):
            assert not imported.startswith(("tensorflow", "keras", "tfdp")), (leaf, imported)


def _cycles(edges):
    """The strongly connected groups of more than one part (Tarjan's algorithm)."""
    graph = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
        graph.setdefault(target, set())
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(part):
        index[part] = low[part] = len(index)
        stack.append(part)
        on_stack.add(part)
        for other in graph[part]:
            if other not in index:
                visit(other)
                low[part] = min(low[part], low[other])
            elif other in on_stack:
                low[part] = min(low[part], index[other])
        if low[part] == index[part]:
            group = set()
            while not group or part not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                cycles.append(sorted(group))

    for part in sorted(graph):
        if part not in index:
            visit(part)
    return cycles


def test_no_import_cycle_between_parts():
    edges = {(s, t) for s, t in _imports() if "__init__" not in (s, t)}
    assert not _cycles(edges), _cycles(edges)
    # The check finds a cycle where there is one.
    assert _cycles(edges | {("accounting", "training")}) != []
