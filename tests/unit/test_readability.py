"""Every function and class of the package is short enough to hold in one's head.

Checked statically with `ast` (no TF import): at most `MAX_FUNCTION_LINES` lines a
function and `MAX_CLASS_LINES` a class, docstrings not counted; and ruff's complexity
limit (pyproject.toml) stays selected.
"""

import ast
import os
import re

from helpers import ROOT

MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300
MAX_COMPLEXITY = 15


def _docstring_lines(node):
    """Lines of every docstring inside `node` (its own and its members')."""
    lines = 0
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            first = inner.body[0] if inner.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines += first.end_lineno - first.lineno + 1
    return lines


def _lengths(source, name="<source>"):
    """`[(qualified name, kind, lines)]` of every function and class in `source`."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                lines = child.end_lineno - child.lineno + 1 - _docstring_lines(child)
                out.append((f"{prefix}{child.name}", kind, lines))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, name), "")
    return out


def _too_long(source, name="<source>"):
    limits = {"function": MAX_FUNCTION_LINES, "class": MAX_CLASS_LINES}
    return [(n, k, lines) for n, k, lines in _lengths(source, name) if lines > limits[k]]


def test_no_function_or_class_of_the_package_is_too_long():
    found = {}
    for folder, _, names in os.walk(os.path.join(ROOT, "tf_asgd")):
        for file in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, file)
            with open(path) as f:
                if long := _too_long(f.read(), path):
                    found[os.path.relpath(path, ROOT)] = long
    assert not found, (
        f"over {MAX_FUNCTION_LINES} lines a function or {MAX_CLASS_LINES} a class "
        f"(docstrings not counted): {found}"
    )


def test_the_checker_counts_code_not_docstrings():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long_doc = '    """' + "\n" * 50 + '    """\n'
    assert _too_long(f"def f():\n{long_doc}    pass\n") == []
    assert _too_long(f"def f():\n{body}\n") == [("f", "function", MAX_FUNCTION_LINES + 1)]
    methods = "\n".join(
        f"    def m{i}(self):\n" + "\n".join(f"        y = {j}" for j in range(9))
        for i in range(MAX_CLASS_LINES // 10 + 1)
    )
    (found,) = _too_long(f"class C:\n{methods}\n")
    assert found[:2] == ("C", "class") and found[2] > MAX_CLASS_LINES


def test_ruffs_complexity_limit_stays():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()  # read as text: tomllib is Python 3.11+
    select = re.search(r"^\[tool\.ruff\.lint\]\nselect = \[(.*?)\]", text, re.M | re.S)
    assert select and '"C90"' in select.group(1)
    limit = re.search(r"^\[tool\.ruff\.lint\.mccabe\]\nmax-complexity = (\d+)", text, re.M)
    assert limit and int(limit.group(1)) <= MAX_COMPLEXITY
