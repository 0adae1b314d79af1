"""Connecting to a cluster is bounded: tasks that do not answer within
`connect_timeout` raise `ClusterUnreachableError` naming each of them, and
nothing of the strategy is left behind; tasks that start a little later are
waited for."""

import inspect
import socket
import threading
import time

import pytest

import tf_asgd
from tf_asgd.cluster import connect
from tf_asgd.cluster.ports import ephemeral_range_start, pick_ports
from tf_asgd.cluster.tf_config import make_resolver

TIMEOUT = 3.0
SLACK = 10.0  # what the bound may be overrun by: one probe round, a loaded machine


@pytest.mark.parametrize("value", [0, -1.0, "30", True, float("inf"), None])
def test_bad_connect_timeout_is_refused_before_any_wait(value):
    spec = {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]}
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="connect_timeout must be a positive number of seconds"):
        tf_asgd.AsyncParameterServerStrategy(make_resolver(spec), connect_timeout=value)
    assert time.perf_counter() - t0 < 1.0


def test_a_port_that_is_no_grpc_server_is_named_so():
    """A wrong host can have something else on the port: TF would wait on it."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    helper = threading.Thread(target=answer, daemon=True)
    helper.start()
    with server:
        reason = connect.probe(f"127.0.0.1:{server.getsockname()[1]}")
    helper.join(5)
    assert reason == "it accepts connections but does not answer as a gRPC server"
    assert connect.probe(f"127.0.0.1:{pick_ports(1)[0]}") == "Connection refused"


def test_cluster_ports_lie_below_the_ephemeral_range():
    """Outgoing connections take their source ports from the ephemeral range: a task's
    port below it cannot be taken while the task is down (by another connection, or by
    a client retrying it and connecting to itself), and the task restarts on it."""
    low = ephemeral_range_start()  # the range the kernel uses
    ports = pick_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 <= p < low for p in ports), (ports, low)
    for port in ports:  # free: a server can listen on each, on every address
        socket.create_server(("", port)).close()


@pytest.mark.parametrize(
    "address, why",
    [
        ("localhost", 'not of the form "host:port"'),
        (":2222", 'not of the form "host:port"'),
        ("localhost:0", "the port '0' is not an integer from 1 to 65535"),
        ("localhost:70000", "the port '70000' is not an integer from 1 to 65535"),
        ("localhost:http", "the port 'http' is not an integer from 1 to 65535"),
    ],
)
def test_an_impossible_address_is_refused_at_once(address, why):
    """No start-up can fix these: refused before any wait, the task and its address named."""
    spec = {"chief": ["localhost:1"], "worker": [address], "ps": ["localhost:3"]}
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="impossible addresses") as info:
        tf_asgd.AsyncParameterServerStrategy(make_resolver(spec))
    assert time.perf_counter() - t0 < 1.0
    assert f"worker:0 {address!r} ({why})" in str(info.value)
    assert "ps:0" not in str(info.value)  # a possible address is not named


def test_a_long_wait_says_soon_then_at_least_every_30_s():
    """The waiting lines: one at once, then 5, 10, 20 s apart, then every 30 s."""
    pace, due = connect.WaitLog(), []
    for tenth in range(0, 1500):  # 150 s in steps of 0.1 s
        if pace.due(tenth / 10):
            due.append(tenth / 10)
    assert due[:5] == [0.0, 5.0, 15.0, 35.0, 65.0]
    gaps = [b - a for a, b in zip(due, due[1:])]
    assert due[0] <= 15 and max(gaps) <= connect.LOG_EVERY_SECS == 30
    assert pace.lines == len(due)


def test_the_default_wait_is_long_enough_for_a_real_cluster():
    """Pods start minutes apart: at least torchrun's 10-minute rendezvous."""
    assert connect.DEFAULT_CONNECT_TIMEOUT >= 600
    parameters = inspect.signature(tf_asgd.AsyncParameterServerStrategy).parameters
    assert parameters["connect_timeout"].default == connect.DEFAULT_CONNECT_TIMEOUT
