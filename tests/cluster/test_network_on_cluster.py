"""Loopback-only namespaces (tf_asgd.cluster.network), in a real child process."""

import os
import subprocess
import sys

import pytest

from tf_asgd.cluster import network

# network.py needs only the standard library: loaded from its file, the child
# starts (twice) without importing TensorFlow.
SCRIPT = f"""
import importlib.util, os, socket, sys
_spec = importlib.util.spec_from_file_location("network", {network.__file__!r})
tf_asgd_network = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tf_asgd_network)
print("before", os.getpid(), flush=True)
tf_asgd_network.reexec_in_loopback_namespace()
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()  # loopback is up
print("inside", os.getpid(), [n for _, n in socket.if_nameindex()], sys.argv[1:], flush=True)
"""


def _available():
    try:
        network.check_available()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _available(), reason="no unprivileged user namespaces on this machine")
def test_reexec_runs_the_same_program_again_with_only_loopback():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop(network.ENV_MARKER, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "--flag", "x"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    lines = out.splitlines()
    # The program ran twice in one process (exec keeps the PID), the second
    # time in a namespace whose only interface is loopback, with its arguments.
    assert lines == [
        f"before {proc.pid}",
        f"before {proc.pid}",
        f"inside {proc.pid} ['lo'] ['--flag', 'x']",
    ], out
