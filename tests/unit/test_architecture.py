"""The package's layering, checked statically (no TF import, no cluster).

Every module under `tf_asgd/` is parsed with `ast`. Imports inside functions count:
a function-level import is an import that runs, only later.
"""

import ast
import functools
import os
import re
import sys

from helpers import ROOT

PACKAGE = os.path.join(ROOT, "tf_asgd")
MAX_PRIVATE_MODULES = 1  # internals.py
PRIVATE_PREFIXES = ("keras.src", "tensorflow.python")


def _modules():
    """`{module name: path}` of every module of the package, subpackages included
    (`tf_asgd.x` for `tf_asgd/x/__init__.py`)."""
    out = {}
    for folder, _, names in os.walk(PACKAGE):
        parts = os.path.relpath(folder, ROOT).split(os.sep)
        for name in names:
            if name.endswith(".py"):
                stem = [] if name == "__init__.py" else [name[:-3]]
                out[".".join(parts + stem)] = os.path.join(folder, name)
    return dict(sorted(out.items()))


MODULES = _modules()


@functools.cache
def _parse(path):
    """`path`'s syntax tree; each file is parsed once for all the checks."""
    with open(path) as f:
        return ast.parse(f.read(), path)


def _imports(path):
    """Every module name imported anywhere in `path` (module level or inside
    functions), absolute. `from tf_asgd import x` names `tf_asgd.x` when `x`
    is a module, else `tf_asgd`."""
    tree = _parse(path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = "tf_asgd" + (f".{node.module}" if node.module else "")
            else:
                base = node.module
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return names


def _graph():
    """`{module: the package's modules it imports}`. Importing `tf_asgd.x`
    also runs the package's `__init__`; that is Python's doing, not an edge:
    only `import tf_asgd` or `from tf_asgd import <not a module>` names it."""
    return {
        module: {name for name in _imports(path) if name in MODULES and name != module}
        for module, path in MODULES.items()
    }


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_checker_sees_imports_inside_functions():
    graph = {"a": {"b"}, "b": {"a"}}
    assert _cycle(graph) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    tree_imports = _imports(MODULES["tf_asgd.data"])  # data imports TF only inside functions
    assert "tensorflow" in tree_imports


def test_no_import_cycle_among_tf_asgd_modules():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The package's layers, lowest first. A module may import modules of its own
# layer or a lower one, never a higher one (docs/architecture.md).
LAYERS = (
    ("errors", "internals", "rules"),  # errors imports nothing of the package (checked below)
    ("optimizers", "data", "models"),
    ("cluster",),
    ("runtime",),
    ("keras_glue",),
    ("strategy",),
    ("launch", "sim"),
)
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def _layer(module):
    """`module`'s layer: that of its subpackage, or of the top-level module itself."""
    return LAYER_OF[module.split(".")[1]]


def test_the_errors_module_imports_nothing_of_the_package():
    """tf_asgd.errors is the bottom floor: any module may raise its errors, and importing it
    loads neither the package's modules nor TensorFlow (the standard library only)."""
    imported = _imports(MODULES["tf_asgd.errors"])
    assert not {n for n in imported if n.split(".")[0] == "tf_asgd"}, imported
    assert all(n.split(".")[0] in sys.stdlib_module_names for n in imported), imported
    assert "tf_asgd.errors" in _graph()["tf_asgd.runtime.steps"]  # the checker sees its users


def test_every_module_has_a_layer():
    for module in MODULES:
        if module != "tf_asgd":  # the package exports everything, lazily
            assert module.split(".")[1] in LAYER_OF, module


def test_imports_run_one_way_down_the_layers():
    upward = sorted(
        f"{module} -> {dep}"
        for module, deps in _graph().items()
        if module != "tf_asgd"
        for dep in deps
        if dep != "tf_asgd" and _layer(dep) > _layer(module)
    )
    assert not upward, "imports from a lower layer to a higher one: " + ", ".join(upward)


def test_the_layer_checker_sees_the_core_edges():
    graph = _graph()
    assert "tf_asgd.runtime.scheduling" in graph["tf_asgd.strategy"]
    assert "tf_asgd.keras_glue.keras_hook" in graph["tf_asgd.strategy"]
    assert "tf_asgd.rules.gem_rule" in graph["tf_asgd.optimizers.gem"]
    assert "tf_asgd.rules.outer_optimizers" in graph["tf_asgd.rules.staleness"]
    assert _layer("tf_asgd.runtime.window") > _layer("tf_asgd.rules.outer")


def test_private_tf_and_keras_imports_stay_in_one_module():
    users = {
        module: sorted(n for n in _imports(path) if n.startswith(PRIVATE_PREFIXES))
        for module, path in MODULES.items()
    }
    users = {m: names for m, names in users.items() if names}
    assert len(users) <= MAX_PRIVATE_MODULES, users


def test_the_keras_version_check_runs_before_any_private_import():
    path = MODULES["tf_asgd.internals"]
    tree = _parse(path)
    check = first_private = None
    for i, node in enumerate(tree.body):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "check_keras_version"
            and check is None
        ):
            check = i
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if first_private is None and any(n.startswith(PRIVATE_PREFIXES) for n in names):
            first_private = i
    assert check is not None and first_private is not None and check < first_private


def test_no_per_model_state_is_set_on_the_model():
    for module, path in MODULES.items():
        with open(path) as f:
            text = f.read()
        assert "_asgd_trainer" not in text and "_asgd_fitting" not in text, module


MAX_MODULE_DOCSTRING_LINES = 15


def _module_docstring_lines(path):
    """Source lines of `path`'s module docstring, quotes included (0 without one)."""
    tree = _parse(path)
    first = tree.body[0] if tree.body else None
    if not (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return 0
    return first.end_lineno - first.lineno + 1


def test_module_docstrings_are_short():
    """A module docstring says what the module is and its contract; how it works is in
    docs/architecture.md. Checked for the package, the benchmarks, the tools and the tests."""
    paths = list(MODULES.values())
    for folder in ("benchmarks", "tools", "tests"):
        for directory, _, names in os.walk(os.path.join(ROOT, folder)):
            paths += [os.path.join(directory, n) for n in names if n.endswith(".py")]
    long = {
        os.path.relpath(p, ROOT): n
        for p in sorted(paths)
        if (n := _module_docstring_lines(p)) > MAX_MODULE_DOCSTRING_LINES
    }
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines: {long}"
    assert _module_docstring_lines(MODULES["tf_asgd.runtime.window"]) > 0  # the checker reads them


def test_unit_tests_start_no_cluster():
    """tests/unit/ is the fast tier: no test there builds a LocalCluster or takes a cluster
    fixture (tests/conftest.py marks everything under tests/cluster/ as `cluster`)."""
    unit = os.path.join(ROOT, "tests", "unit")
    fixtures = {"cluster", "local_cluster", "sharded_cluster", "digits_cluster"}
    found = []
    for name in sorted(os.listdir(unit)):
        if not name.endswith(".py"):
            continue
        tree = _parse(os.path.join(unit, name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and "LocalCluster" in ast.unparse(node.func):
                found.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found += [f"{name}:{node.name}" for a in node.args.args if a.arg in fixtures]
    assert not found


# The layers below the strategy talk to it through its public interface only (its
# options, `model_states`, `training_data`, `outer_state`, `check_connected`) or get what
# they need as arguments; its one private name they may read is the marker by which
# they recognise it without importing it.
BELOW_THE_STRATEGY = ("runtime", "optimizers", "keras_glue")
STRATEGY_MARKER = "_is_tf_asgd_strategy"


def _is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_strategy_uses(tree):
    """`(line, source)` of each private attribute read or called on an expression
    that is a strategy (its source names one: `strategy`, `self.strategy`,
    `_strategy_of(model)`), directly or through `getattr` with a constant name."""
    found = []
    for node in ast.walk(tree):
        target = name = None
        if isinstance(node, ast.Attribute):
            target, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            target, name = node.args[0], node.args[1].value
        if (
            target is not None
            and _is_private(name)
            and name != STRATEGY_MARKER
            and "strategy" in ast.unparse(target).lower()
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_strategy_checker_sees_private_uses():
    source = (
        "strategy._trainer_of(model)\n"
        "self.strategy._steps_per_epoch\n"
        "_strategy_of(model)._set_fitting(model, True)\n"
        "getattr(trainer.strategy, '_fitting')\n"
        "getattr(strategy, '_is_tf_asgd_strategy', False)\n"
        "strategy.model_states.get(model).trainer\n"
        "self._trainer.strategy.counters\n"
        "type(strategy).__name__\n"
    )
    found = sorted(line for line, _ in _private_strategy_uses(ast.parse(source)))
    assert found == [1, 2, 3, 4], found


def test_the_layers_below_the_strategy_use_only_its_public_interface():
    found = [
        f"{module}:{line}: {text}"
        for module, path in MODULES.items()
        if module.split(".")[1:2] and module.split(".")[1] in BELOW_THE_STRATEGY
        for line, text in _private_strategy_uses(_parse(path))
    ]
    assert not found, "private strategy names used below it: " + "; ".join(found)


def test_no_test_file_name_is_used_twice():
    """A test file is found by its name: the cluster tier's twin of a unit file is
    `test_<name>_on_cluster.py` (docs/guide/development.md)."""
    seen = {}
    for directory, _, names in os.walk(os.path.join(ROOT, "tests")):
        for name in names:
            if name.startswith("test_") and name.endswith(".py"):
                seen.setdefault(name, []).append(os.path.relpath(directory, ROOT))
    assert not {n: dirs for n, dirs in seen.items() if len(dirs) > 1}


def test_the_module_to_tests_table_is_whole_and_names_real_files():
    """docs/guide/development.md's table names every module of the package, and each
    test file it names exists."""
    with open(os.path.join(ROOT, "docs", "guide", "development.md")) as f:
        text = f.read()
    table = text.split("### Where a module is tested", 1)[1].split("\n#", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named = {m for row in rows for m in re.findall(r"`([\w/]+\.py)`", row.split(" | ")[0])}
    modules = {
        os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        for path in MODULES.values()
        if not path.endswith("__init__.py") or "optimizers" in path
    }
    assert modules <= named, sorted(modules - named)
    cited = {t for row in rows for t in re.findall(r"`((?:unit|cluster)/test_\w+\.py)", row)}
    missing = sorted(t for t in cited if not os.path.exists(os.path.join(ROOT, "tests", t)))
    assert cited and not missing, missing
