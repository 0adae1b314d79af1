"""A LocalCluster's task processes are forked from one TensorFlow import per
process (`tf_asgd.cluster.task_forks`): they start, fail, die and stop as
processes of their own do, and the fork server stops with the last cluster."""

import signal
import socket

import pytest

import tf_asgd
from tf_asgd.cluster import task_forks

from launching import alive, parent_pid

pytestmark = pytest.mark.skipif(not task_forks.available(), reason="needs pidfds (Linux 5.3)")


@pytest.fixture
def own_forks(monkeypatch):
    """An environment of this test's own: its clusters get a fork server no
    other open cluster of this process shares (one per environment)."""
    monkeypatch.setenv("TF_ASGD_TEST_OWN_FORKS", "1")


def test_forked_tasks_report_their_status_restart_and_all_stop(own_forks):
    with tf_asgd.LocalCluster(1, 1) as cluster:
        forks = cluster.fork_server_pid
        first = cluster.pids()
        assert set(first) == {"ps:0", "worker:0"}
        assert {parent_pid(pid) for pid in first.values()} == {forks}

        cluster.kill_task("worker:0")
        assert "worker:0" not in cluster.pids()
        assert cluster._procs["worker:0"].returncode == -signal.SIGKILL  # private: as Popen's

        # Its port is held until it restarts: no other process can take it, and a
        # client still finds the connection refused.
        port = int(cluster.cluster_spec["worker"][0].split(":")[1])
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("localhost", port))
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("localhost", port))

        # A task that cannot listen exits at once, and its status says so.
        cluster._release_port("worker:0")  # private: to let another socket take the port
        with socket.socket() as taken:
            taken.bind(("localhost", port))
            taken.listen()
            with pytest.raises(RuntimeError, match=r"worker:0 did not start \(exit code 1\)"):
                cluster.restart_task("worker:0", timeout=60)

        cluster.restart_task("worker:0")
        again = cluster.pids()
        assert again["ps:0"] == first["ps:0"] and again["worker:0"] != first["worker:0"]
        assert parent_pid(again["worker:0"]) == forks
    assert not any(alive(pid) for pid in [forks, *first.values(), *again.values()])


def test_open_clusters_share_one_fork_server_until_the_last_closes(own_forks):
    one = tf_asgd.LocalCluster(1, 1, shared_process=True)
    try:
        with tf_asgd.LocalCluster(2, 1) as two:
            forks = one.fork_server_pid
            assert two.fork_server_pid == forks
            tasks = [*one.pids().values(), *two.pids().values()]
            assert {parent_pid(pid) for pid in tasks} == {forks}
            one.close()
            assert alive(forks)
    finally:
        one.close()
    assert not any(alive(pid) for pid in [forks, *tasks])
