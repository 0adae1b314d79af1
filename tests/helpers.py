"""What tests share besides fixtures: the repository root, the digits model's compile, the
supported versions as internals.py states them, and a bounded call for error-path tests."""

import ast
import faulthandler
import os
import sys
import threading
import time

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_digits(model, optimizer=None):
    """Compiles `model` for digits: logits, sparse labels, accuracy; SGD(0.05, m 0.9) by default."""
    model.compile(
        optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def supported_versions():
    """`SUPPORTED_KERAS`, `SUPPORTED_TF` read from internals.py's source."""
    with open(os.path.join(ROOT, "tf_asgd", "internals.py")) as f:
        tree = ast.parse(f.read())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("SUPPORTED_KERAS", "SUPPORTED_TF"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return values["SUPPORTED_KERAS"], values["SUPPORTED_TF"]


ERROR_BOUND_SECS = 30  # an error reaches the user within 30 s


def bounded(fn, seconds):
    """Runs `fn()` in a thread; returns `(value, exception, seconds taken)`.

    Fails the test if `fn` has not returned or raised after `seconds`.
    """
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # KeyboardInterrupt included: it is what we test
            out["error"] = e

    # If the hang holds the GIL, join's timeout cannot return: end the
    # process (with every thread's traceback) rather than hang the suite.
    faulthandler.dump_traceback_later(seconds + 120, exit=True, file=sys.stderr)
    t0 = time.time()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    secs = time.time() - t0
    faulthandler.cancel_dump_traceback_later()
    if thread.is_alive():
        pytest.fail(f"no result and no error after {seconds} s: the call hangs")
    return out.get("value"), out.get("error"), secs
