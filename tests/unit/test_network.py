"""Loopback-only namespaces (tf_asgd.cluster.network), in a real child process."""

import pytest

from tf_asgd.cluster import network

SCRIPT = """
import os, socket, sys
import tf_asgd
print("before", os.getpid(), flush=True)
tf_asgd.cluster.network.reexec_in_loopback_namespace()
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()  # loopback is up
print("inside", os.getpid(), [n for _, n in socket.if_nameindex()], sys.argv[1:], flush=True)
"""


def test_check_available_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(OSError, match=r"the `unshare` command \(util-linux\) is not installed"):
        network.check_available()
