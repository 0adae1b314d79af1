"""The API reference (docs/api/) covers every name of `tf_asgd.__all__`, checked statically.

`tf_asgd/__init__.py` is parsed with `ast` (no TF import); the `:::` directives of
docs/api/*.md are read as text. Whether each directive resolves is mkdocs's to check
(`mkdocs build --strict` in .ci/run).
"""

import ast
import glob
import os
import re

from helpers import ROOT

DIRECTIVE = re.compile(r"^:::\s+(\S+)\s*$", re.MULTILINE)


def _package_exports():
    """`(__all__, {exported name: its module}, submodules)` of `tf_asgd/__init__.py`."""
    with open(os.path.join(ROOT, "tf_asgd", "__init__.py")) as f:
        tree = ast.parse(f.read())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                values[target.id] = ast.literal_eval(node.value)
    return values["__all__"], values["_EXPORTS"], values["_SUBMODULES"]


def _directives():
    """`{dotted path: page}` of every `::: path` directive under docs/api/."""
    found = {}
    for page in sorted(glob.glob(os.path.join(ROOT, "docs", "api", "*.md"))):
        with open(page) as f:
            for path in DIRECTIVE.findall(f.read()):
                found[path] = os.path.basename(page)
    return found


def test_every_public_name_has_a_directive():
    names, exports, submodules = _package_exports()
    assert set(names) == set(exports) | set(submodules)  # __all__ is what __init__ loads
    directives = _directives()
    missing = []
    for name in names:
        if name in exports:
            # The object in the module `_EXPORTS` names: `::: tf_asgd.errors.TrainStepError`.
            covered = f"{exports[name]}.{name}" in directives
        else:
            # A public submodule: the module itself or something inside it.
            covered = any(
                path == f"tf_asgd.{name}" or path.startswith(f"tf_asgd.{name}.")
                for path in directives
            )
        if not covered:
            missing.append(name)
    assert not missing, f"no `:::` directive under docs/api/ for {missing}"


def test_every_api_page_is_in_the_nav():
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = f.read()
    pages = sorted(glob.glob(os.path.join(ROOT, "docs", "api", "*.md")))
    assert pages
    for page in pages:
        assert f"api/{os.path.basename(page)}" in nav, page
