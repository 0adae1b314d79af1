"""The supported Keras / TensorFlow range: refused clearly outside it, the
same range in pyproject.toml and in the check (tools/dev/compat.py measures it)."""

import os
import subprocess
import sys

from helpers import ROOT


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
