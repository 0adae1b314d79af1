"""`LocalCluster`: a cluster of TF servers on loopback, as child processes.

A `LocalCluster` starts parameter-server and worker tasks as child processes bound to
loopback ports, and always stops them: on `close()`, on leaving its `with` block (also on
an exception or Ctrl-C), at interpreter exit, and, through a stdin lifeline, when the
parent process dies.

Example:
    with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
"""

import atexit
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tf_asgd.cluster import network, task_forks
from tf_asgd.cluster.ports import pick_ports
from tf_asgd.cluster.tf_config import make_resolver
from tf_asgd.cluster.tf_startup import TASK_SERVER, python_command

READY = "TF_ASGD_READY"  # printed by tf_asgd.cluster.task_server once it listens

# Per cluster (its worker and ps addresses): what to stop before its tasks stop.
_BEFORE_STOP = {}
_SERVING = set()  # the task sets of this process's open LocalClusters


def before_stop(cluster_spec, fn):
    """Registers `fn()` to run when the `LocalCluster` serving `cluster_spec`
    (a dict) closes, before its tasks stop. A strategy registers the stop of
    its coordinator: TF's coordinator keeps polling a cluster that is gone,
    and its failure handler then reconnects this process's eager context to
    it (`update_server_def`), which breaks the strategy of the next cluster
    ("unknown device"). A cluster no `LocalCluster` here serves (one from
    `TF_CONFIG`) never closes here, so nothing is kept for it."""
    key = _tasks_key(cluster_spec)
    if key in _SERVING:
        _BEFORE_STOP.setdefault(key, []).append(fn)


def _tasks_key(cluster_spec):
    return frozenset(a for job in ("worker", "ps") for a in cluster_spec.get(job, []))


def _mark_gone(addresses, gone=True):
    """Tells this process's TF client that the tasks at `addresses` stopped
    (or, `gone=False`, are back): a tf.function freed while it is connected
    to them is then not removed from the cluster, one synchronous RPC per
    task, each an error logged for a task that is gone (see
    `internals.mark_tasks_gone`). Nothing to do if TF was never imported."""
    if "tensorflow" in sys.modules:
        from tf_asgd import internals

        internals.mark_tasks_gone(addresses, gone)


_LIMITING = {}  # id(LocalCluster) -> bits/s, for the open clusters with a bandwidth


def _limit_bandwidth(cluster):
    """Sets `cluster.bandwidth` on this namespace's loopback (one link for all its clusters)."""
    others = set(_LIMITING.values()) - {cluster.bandwidth}
    if others:
        raise ValueError(
            f"LocalCluster(bandwidth={cluster.bandwidth}): another open LocalCluster limits "
            f"this namespace's loopback to {others.pop()} bits/s, and all of them share one "
            "link. Close it first, or give both the same bandwidth."
        )
    network.limit_bandwidth(cluster.bandwidth)
    _LIMITING[id(cluster)] = cluster.bandwidth


def _release_bandwidth(cluster):
    """Removes the limit once the last open cluster that set it closes."""
    if _LIMITING.pop(id(cluster), None) is not None and not _LIMITING:
        network.clear_bandwidth_limit()


def _task_env(tasks, gpus_per_worker):
    """The environment of a process hosting `tasks` (none: a fork server's)."""
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    workers = [int(t.split(":")[1]) for t in tasks if t.startswith("worker")]
    if gpus_per_worker and len(workers) == 1 and len(tasks) == 1:
        first = workers[0] * gpus_per_worker
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(gpus_per_worker))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def fork_server_spec():
    """The command line and environment of the fork server (`task_forks`) of
    this process's clusters without GPUs."""
    return python_command(TASK_SERVER, [task_forks.FORKS]), _task_env([], 0)


class LocalCluster:
    """N workers and M parameter servers on loopback, as child processes.

    Args:
        num_workers: worker tasks.
        num_ps: parameter-server tasks.
        shared_process: host all tasks in one child process instead of one
            process per task (tasks can then be killed one by one). Without
            GPUs, task processes are forked from one process that imported
            TensorFlow once (`task_forks`), shared by this process's open
            clusters.
        gpus_per_worker: GPUs given to each worker process through
            `CUDA_VISIBLE_DEVICES`; 0 hides all GPUs. PS tasks never see a GPU.
        start_timeout: seconds to wait for the servers to come up.
        bandwidth: limit the loopback to this many bits/s, or a string like
            `"100mbit"` or `"1gbit"` (`network.parse_bandwidth`); `None`: no
            limit. Needs this process in a loopback-only namespace of its own
            (`network.reexec_in_loopback_namespace`; the launcher's
            `--bandwidth`), where the chief and the tasks share one link. The
            limit holds while the cluster is open; `close()` removes it.

    Attributes:
        cluster_spec: the cluster dict, `{"chief": [...], "worker": [...],
            "ps": [...]}` of "localhost:port" addresses (the chief's is a
            placeholder: `resolver` picks a fresh one).
        num_workers: as given.
        num_ps: as given.
        shared_process: as given.
        gpus_per_worker: as given.
        bandwidth: the limit in bits/s, or `None`.

    Raises:
        ValueError: bad counts, a bad bandwidth, or another open cluster
            limits this namespace to another bandwidth.
        RuntimeError: `bandwidth` outside a namespace of its own, or a task
            that did not start within `start_timeout` (every task is then stopped).
        OSError: the kernel refused the limit (`tc` missing, no tbf qdisc).

    Example:

    ```python
    with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
        ...
        cluster.kill_task("worker:1")  # fault injection (one process per task)
        cluster.restart_task("worker:1")
    ```
    """

    def __init__(
        self,
        num_workers=2,
        num_ps=1,
        shared_process=False,
        gpus_per_worker=0,
        start_timeout=120.0,
        bandwidth=None,
    ):
        if num_workers < 1 or num_ps < 1:
            raise ValueError(
                "A LocalCluster needs at least one worker and one ps, got "
                f"num_workers={num_workers}, num_ps={num_ps}."
            )
        self.bandwidth = None if bandwidth is None else network.parse_bandwidth(bandwidth)
        if self.bandwidth is not None:
            _limit_bandwidth(self)
        self.num_workers, self.num_ps = num_workers, num_ps
        self.shared_process = shared_process
        self.gpus_per_worker = gpus_per_worker
        self._procs = {}  # "job:index" -> Popen or ForkedTask; a shared host is "all"
        self._forks = None  # the task_forks.ForkServer its tasks come from (None: own starts)
        self._held = {}  # "job:index" -> a socket bound on a killed task's port (`kill_task`)
        self._lock = threading.Lock()
        ports = pick_ports(num_workers + num_ps + 1)
        self.cluster_spec = {
            "chief": [f"localhost:{ports[0]}"],
            "worker": [f"localhost:{p}" for p in ports[1 : 1 + num_workers]],
            "ps": [f"localhost:{p}" for p in ports[1 + num_workers :]],
        }
        _SERVING.add(_tasks_key(self.cluster_spec))
        atexit.register(self.close)
        try:
            self._start(start_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def resolver(self):
        """A resolver from the chief's view, with a fresh chief port each time.

        A process that connected to a cluster keeps that chief's gRPC server
        (TF cannot stop it), so connecting again, to this cluster after
        another one, needs a port of its own. Workers and PS never dial the
        chief, so its address may change between connections.

        Returns:
            A `tf.distribute.cluster_resolver.SimpleClusterResolver` (task
            "chief", index 0, gRPC) for `AsyncParameterServerStrategy`.
        """
        return make_resolver(dict(self.cluster_spec, chief=[f"localhost:{pick_ports(1)[0]}"]))

    def tasks(self):
        """The cluster's ps and worker task names.

        Returns:
            A list of `"job:index"` names, the ps tasks first: `["ps:0",
            "worker:0", "worker:1"]`, as `kill_task` and `restart_task` take them.
        """
        return [f"ps:{i}" for i in range(self.num_ps)] + [
            f"worker:{i}" for i in range(self.num_workers)
        ]

    def _spawn(self, tasks, deadline):
        if self._forks is not None:
            return self._forks.spawn(self.cluster_spec, tasks, deadline)
        return subprocess.Popen(
            python_command(TASK_SERVER, [json.dumps(self.cluster_spec), ",".join(tasks)]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_task_env(tasks, self.gpus_per_worker),
            text=True,
        )

    def _start(self, timeout):
        deadline = time.time() + timeout
        # One TF import for all the process's clusters, tasks and restarts;
        # tasks with GPUs start on their own (CUDA initialised under their devices).
        if not self.gpus_per_worker and task_forks.available():
            self._forks = task_forks.acquire(*fork_server_spec())
        groups = [self.tasks()] if self.shared_process else [[t] for t in self.tasks()]
        for group in groups:
            self._procs["all" if self.shared_process else group[0]] = self._spawn(group, deadline)
        for name, proc in self._procs.items():
            self._wait_ready(name, proc, deadline)

    @property
    def fork_server_pid(self):
        """The process id of the process the tasks were forked from
        (`task_forks`), shared by this process's open clusters; `None` where
        each task started on its own (GPUs given, or no pidfds)."""
        return None if self._forks is None else self._forks.pid

    def _wait_ready(self, name, proc, deadline):
        result = {}

        def read():
            for line in proc.stdout:
                if line.strip() == READY:
                    result["ok"] = True
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.time()))
        if not result.get("ok"):
            try:  # its stdout closed: it is exiting
                code = proc.wait(timeout=5) if not reader.is_alive() else proc.poll()
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(
                f"TF server task {name} did not start "
                + (f"(exit code {code})." if code is not None else "in time.")
            )

    def restart_task(self, task, timeout=120.0):
        """Starts a task again on its old port (killing it first if it still runs).

        What training does meanwhile and after: docs/faults.md.

        Args:
            task: a name from `tasks()`, e.g. "worker:1"; with
                `shared_process=True`, "all" (the one process hosting every task).
            timeout: seconds to wait for the new server to listen.

        Raises:
            ValueError: the cluster was made with `shared_process=True` and
                `task` is not "all" (its tasks cannot be restarted one by one).
            RuntimeError: the task did not start within `timeout`.
        """
        if self.shared_process and task != "all":
            raise ValueError(
                f"restart_task({task!r}): with shared_process=True one process hosts every "
                "task; restart_task('all') restarts them all."
            )
        tasks = self._hosted(task)
        self.kill_task(task)
        _mark_gone(self._addresses(tasks), gone=False)
        for name in tasks:
            self._release_port(name)
        proc = self._spawn(tasks, time.time() + timeout)
        self._procs[task] = proc
        self._wait_ready(task, proc, time.time() + timeout)

    def kill_task(self, task, sig=signal.SIGKILL):
        """Kills one task's process (for fault injection) and waits for it to exit.

        Its port stays bound, not listening, until `restart_task`: connections
        to it are refused, and no other process can take it meanwhile.
        Nothing happens for a task that is not running, or a name this
        cluster does not have.

        Args:
            task: a name from `tasks()`, e.g. "worker:1"; with
                `shared_process=True`, "all" (the one process hosting every task).
            sig: the signal sent; `SIGKILL` by default, as a crash would.
        """
        proc = self._procs.get(task)
        if proc is not None and proc.poll() is None:
            _mark_gone(self._addresses(self._hosted(task)))
            proc.send_signal(sig)
            proc.wait(timeout=30)
            for name in self._hosted(task):
                self._hold_port(name)

    def _hosted(self, task):
        """The task names the process `task` hosts: every task for "all" (the shared one)."""
        return self.tasks() if task == "all" else [task]

    def _hold_port(self, task):
        """Binds a killed task's port until `restart_task`, so that no other process
        (another cluster picking free ports) takes it meanwhile. Bound, not listening:
        a client still finds the connection refused."""
        port = int(self._addresses([task])[0].rsplit(":", 1)[1])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # As gRPC does: the dead server's connections may linger in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:  # taken already: nothing to hold
            sock.close()
            return
        self._held[task] = sock

    def _release_port(self, task):
        sock = self._held.pop(task, None)
        if sock is not None:
            sock.close()

    def _addresses(self, tasks):
        return [self.cluster_spec[t.split(":")[0]][int(t.split(":")[1])] for t in tasks]

    def pids(self):
        """The process id of each running task process.

        Returns:
            A dict `{task name: pid}` ("all" for the shared process), without
            the tasks that were killed or have exited.
        """
        return {t: p.pid for t, p in self._procs.items() if p.poll() is None}

    def processes(self):
        """Each task's process, running or not (`Restarter` restarts those that exited).

        Returns:
            A dict `{task name: process}` ("all" for the shared process): a
            `subprocess.Popen` or a forked task with `poll()` and `pid`.
        """
        return dict(self._procs)

    def close(self):
        """Stops every task. Safe to call more than once; also run at interpreter exit.

        Before the tasks stop, the coordinators of the strategies connected to
        this cluster are stopped, and the cluster's `bandwidth` limit is removed
        (once no other open cluster set it).

        In an order that logs no error: a tf.function freed on a client
        connected to the cluster is removed from every task, one synchronous
        RPC each; quick while the task is up, an error logged per function
        and task once it is gone. So this process's garbage is collected
        while the tasks still answer, then the tasks are marked gone (what is
        freed later is not removed from them), then they are stopped. Tasks
        that died before (killed, crashed) are marked gone first.
        """
        _release_bandwidth(self)
        _SERVING.discard(_tasks_key(self.cluster_spec))
        for fn in _BEFORE_STOP.pop(_tasks_key(self.cluster_spec), []):
            fn()
        with self._lock:
            procs, self._procs = dict(self._procs), {}
        dead = [t for t, proc in procs.items() if proc.poll() is not None]  # killed, crashed
        if dead:
            _mark_gone(self._addresses(self.tasks() if "all" in dead else dead))
        if len(dead) < len(procs):
            gc.collect()
        if procs:
            _mark_gone(self._addresses(self.tasks()))
        procs = list(procs.values())
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()  # the lifeline: the host exits on EOF
                except OSError:
                    pass
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        if self._forks is not None:
            task_forks.release(self._forks)
            self._forks = None
        for sock in self._held.values():
            sock.close()
        self._held.clear()
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RestartLostTasks:
    """Restarts each task of `job` whose process exits, on its old port, until stopped:
    what a job controller does for a pod. The launcher's local runs use it for their
    parameter servers, which the strategy then recovers (`runtime.ps_recovery`).

    Args:
        cluster: a `LocalCluster`; with `shared_process=True` its one process is
            restarted, with every task in it.
        job: the tasks' job, e.g. "ps".
        poll_secs: how often the processes are looked at.

    Attributes:
        restarted: the names of the tasks restarted, in order.
    """

    def __init__(self, cluster, job, poll_secs=0.5):
        self.cluster, self.job, self.poll_secs = cluster, job, poll_secs
        self.restarted = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tf_asgd_restarts", daemon=True)

    def start(self):
        """Starts watching; returns self."""
        self._thread.start()
        return self

    def stop(self):
        """Stops watching (waits for a restart under way)."""
        self._stop.set()
        self._thread.join()

    def _run(self):
        log = logging.getLogger("tf_asgd")
        while not self._stop.wait(self.poll_secs):
            for task, proc in self.cluster.processes().items():
                # "all": a shared process, which hosts this job's tasks too
                if not (task == "all" or task.startswith(self.job + ":")) or proc.poll() is None:
                    continue
                log.warning(
                    "%s exited (%s); restarting %s",
                    "The process of every task" if task == "all" else task,
                    _exit_reason(proc.returncode),
                    "them on their ports" if task == "all" else "it on its port",
                )
                try:
                    self.cluster.restart_task(task)
                    self.restarted.append(task)
                    log.warning("%s restarted (pid %d)", task, self.cluster.pids()[task])
                except (RuntimeError, OSError) as e:
                    log.warning("Could not restart %s: %s", task, e)
                    return


def _exit_reason(code):
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
