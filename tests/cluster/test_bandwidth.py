"""An emulated slow network: a token bucket on the loopback of the job's own namespace."""

import os
import shutil
import subprocess
import sys

import pytest

import tf_asgd
from tf_asgd.cluster import network

# network.py needs only the standard library: loaded from its file, a child that
# uses nothing else starts (and re-executes itself) without importing TensorFlow.
NETWORK_ONLY = f"""
import importlib.util
_spec = importlib.util.spec_from_file_location("network", {network.__file__!r})
network = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(network)
"""

# Measures a loopback TCP transfer of about `seconds` at `rate` bits/s, at the receiver
# (from its first chunk to the last, so a connection's start does not count).
TRANSFER = """
import socket, sys, threading, time

def transfer_rate(rate, seconds=1.0):
    total = int(rate / 8 * seconds)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    result = {}

    def receive():
        conn, _ = server.accept()
        got, first, t0 = 0, 0, None
        while True:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            if t0 is None:
                t0, first = time.perf_counter(), len(chunk)
            got += len(chunk)
        result["rate"] = 8 * (got - first) / (time.perf_counter() - t0)
        result["got"] = got
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    client = socket.create_connection(server.getsockname(), timeout=60)
    buf, sent = b"\\0" * (1 << 20), 0
    while sent < total:
        n = min(len(buf), total - sent)
        client.sendall(buf[:n])
        sent += n
    client.close()
    thread.join(60)
    server.close()
    assert result["got"] == total, result
    return result["rate"]

network.reexec_in_loopback_namespace()
"""

LIMITS = (
    NETWORK_ONLY
    + TRANSFER
    + """
for arg in sys.argv[1:]:
    rate = network.limit_bandwidth(arg)
    print("limit", arg, *network.bandwidth_limit(), transfer_rate(rate), flush=True)
network.clear_bandwidth_limit()
print("cleared", network.bandwidth_limit(), transfer_rate(1e9), flush=True)
"""
)

CLUSTER = (
    "from tf_asgd.cluster import network\n"
    + TRANSFER
    + """
import tf_asgd
with tf_asgd.LocalCluster(num_workers=1, shared_process=True, bandwidth="100mbit") as c:
    print("open", *network.bandwidth_limit(), transfer_rate(c.bandwidth), flush=True)
    try:
        tf_asgd.LocalCluster(num_workers=1, bandwidth="1gbit")
    except ValueError as e:
        print("refused", e, flush=True)
print("closed", network.bandwidth_limit(), flush=True)
"""
)


def _skip_reason():
    try:
        network.check_available()
    except OSError as e:
        return f"no loopback-only namespace here: {e}"
    tc = shutil.which("tc") or "/usr/sbin/tc"
    if not os.access(tc, os.X_OK):
        return "the `tc` command (iproute2) is not installed"
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--net", tc, "qdisc", "add", "dev", "lo"]
        + ["root", "tbf", "rate", "1gbit", "burst", "2mbit", "latency", "50ms"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        return f"the kernel refuses a tbf qdisc in a user namespace: {probe.stderr.strip()}"
    return None


SKIP = _skip_reason()
needs_tc = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _run(script, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop(network.ENV_MARKER, None)
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line.split(" ", 1) for line in proc.stdout.splitlines()]


@needs_tc
def test_a_transfer_runs_near_the_set_rate_and_unlimited_once_cleared():
    lines = _run(LIMITS, "200mbit", "1gbit")
    measured = {}
    for kind, rest in lines:
        if kind == "limit":
            name, rate, burst, got = rest.split()
            measured[name] = (int(rate), int(burst), float(got))
    assert measured["200mbit"][:2] == (200_000_000, 250_000)
    assert measured["1gbit"][:2] == (1_000_000_000, 1_250_000)
    for rate, _, got in measured.values():
        assert 0.7 * rate <= got <= 1.3 * rate, measured
    kind, rest = lines[-1]
    limit, got = rest.split()
    # Without the bucket, loopback runs well past 1 Gbit/s (about 13 Gbit/s measured here).
    assert kind == "cleared" and limit == "None" and float(got) > 2e9, lines


@needs_tc
def test_a_local_cluster_limits_its_namespace_while_open():
    lines = dict(_run(CLUSTER))
    rate, burst, got = lines["open"].split()
    assert (int(rate), int(burst)) == (100_000_000, 125_000)
    assert 0.7e8 <= float(got) <= 1.3e8, lines
    assert (
        "another open LocalCluster limits this namespace's loopback to 100000000"
        in (lines["refused"])
    )
    assert lines["closed"] == "None"


def test_a_local_cluster_outside_its_own_namespace_refuses_a_bandwidth():
    assert not network.in_loopback_namespace()
    with pytest.raises(RuntimeError, match=r"not in a loopback-only network namespace of its own"):
        tf_asgd.LocalCluster(num_workers=1, bandwidth="100mbit")
    with pytest.raises(ValueError, match=r"bandwidth must be .* got 'fast'"):
        tf_asgd.LocalCluster(num_workers=1, bandwidth="fast")
