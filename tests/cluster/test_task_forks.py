"""A LocalCluster with one process per task forks its tasks from one TensorFlow
import (`tf_asgd.cluster.task_forks`): they start, fail, die and stop as
processes of their own do."""

import signal
import socket

import pytest

from tf_asgd.cluster import task_forks

from launching import alive

pytestmark = pytest.mark.skipif(not task_forks.available(), reason="needs pidfds (Linux 5.3)")


def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[-1].split()[1])


def test_forked_tasks_report_their_status_restart_and_all_stop(local_cluster):
    with local_cluster(1, own=True, shared_process=False) as cluster:
        forks = cluster._forks.pid  # private: which process forks is not API
        first = cluster.pids()
        assert set(first) == {"ps:0", "worker:0"}
        assert {_parent(pid) for pid in first.values()} == {forks}

        cluster.kill_task("worker:0")
        assert "worker:0" not in cluster.pids()
        assert cluster._procs["worker:0"].returncode == -signal.SIGKILL  # as Popen says it

        # A task that cannot listen exits at once, and its status says so.
        port = int(cluster.cluster_spec["worker"][0].split(":")[1])
        with socket.socket() as taken:
            taken.bind(("localhost", port))
            taken.listen()
            with pytest.raises(RuntimeError, match=r"worker:0 did not start \(exit code 1\)"):
                cluster.restart_task("worker:0", timeout=60)

        cluster.restart_task("worker:0")
        again = cluster.pids()
        assert again["ps:0"] == first["ps:0"] and again["worker:0"] != first["worker:0"]
        assert _parent(again["worker:0"]) == forks
    assert not any(alive(pid) for pid in [forks, *first.values(), *again.values()])
