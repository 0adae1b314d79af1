"""The supported Keras / TensorFlow range: refused clearly outside it, the
same range in pyproject.toml and in the check (tools/compat.py measures it)."""

import ast
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from tf_asgd import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _supported():
    """`SUPPORTED_KERAS`, `SUPPORTED_TF` read from internals.py's source."""
    with open(os.path.join(ROOT, "tf_asgd", "internals.py")) as f:
        tree = ast.parse(f.read())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("SUPPORTED_KERAS", "SUPPORTED_TF"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return values["SUPPORTED_KERAS"], values["SUPPORTED_TF"]


@pytest.mark.cluster  # a fresh process imports TensorFlow: not the fast tier
def test_import_on_an_unsupported_keras_or_tf_names_the_range():
    """`import tf_asgd` with Keras 3.12 or TF 2.18 (faked) fails with a
    RuntimeError naming the supported range (the check runs before any
    private import: test_architecture), not an ImportError."""
    script = (
        "import keras, sys, tensorflow as tf\n"
        "for mod, fake in ((keras, '3.12.0'), (tf, '2.18.1')):\n"
        "    real, mod.__version__ = mod.__version__, fake\n"
        "    try:\n"
        "        import tf_asgd\n"
        "        print('IMPORTED')\n"
        "    except Exception as e:\n"
        "        print(f'{type(e).__name__}: {e}')\n"
        "    mod.__version__ = real\n"
        "    for m in [m for m in sys.modules if m.startswith('tf_asgd')]: del sys.modules[m]\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    ).stdout
    lines = [
        ln for ln in out.splitlines() if ln.startswith(("RuntimeError", "IMPORTED", "ImportError"))
    ]
    assert len(lines) == 2, out
    for line, found in zip(lines, ("Keras 3.12.0", "TensorFlow 2.18.1")):
        assert line.startswith(
            "RuntimeError: tf_asgd supports Keras 3.13 to 3.15 and TensorFlow "
            "2.19 to 2.21; found " + found
        ), line
        assert 'pip install "keras>=3.13,<3.16" "tensorflow>=2.19,<2.22"' in line


def test_pyproject_admits_exactly_the_supported_range():
    keras_minors, tf_minors = _supported()
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()

    def upper(minor):
        major, m = minor.split(".")
        return f"{major}.{int(m) + 1}"

    assert f'"keras>={keras_minors[0]},<{upper(keras_minors[-1])}"' in text
    for name in ("tensorflow", "tensorboard", "tensorflow[and-cuda]", "tf-keras"):
        pins = re.findall(rf'"{re.escape(name)}([<>=][^"]*)"', text)
        assert pins and set(pins) == {f">={tf_minors[0]},<{upper(tf_minors[-1])}"}, (name, pins)
    for minors in (keras_minors, tf_minors):  # consecutive minors, no gap
        nums = [int(m.split(".")[1]) for m in minors]
        assert nums == list(range(nums[0], nums[0] + len(nums)))


def test_cifar_batches_are_read_without_running_pickled_code(tmp_path):
    batch = {b"data": np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072), b"labels": [3, 7]}
    with open(tmp_path / "good", "wb") as f:
        pickle.dump(batch, f)
    x, y = data.load_cifar_batch(str(tmp_path / "good"))
    assert x.shape == (2, 3, 32, 32) and x.dtype == np.uint8 and list(y) == [3, 7]

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with open(tmp_path / "evil", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(pickle.UnpicklingError, match="Refusing to unpickle"):
        data.load_cifar_batch(str(tmp_path / "evil"))
    assert not (tmp_path / "pwned").exists()
