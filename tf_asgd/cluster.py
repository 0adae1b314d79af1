"""Clusters: `TF_CONFIG` parsing and local loopback clusters of TF servers.

A `LocalCluster` starts parameter-server and worker tasks as child
processes bound to loopback ports, and always stops them: on `close()`, on
leaving its `with` block (also on an exception or Ctrl-C), at interpreter
exit, and, through a stdin lifeline, when the parent process dies.

Example:

```python
import tf_asgd
with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
    ...
```
"""

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

_READY = "TF_ASGD_READY"  # printed by tf_asgd.task_server once it listens

ROLES = ("chief", "worker", "ps", "evaluator")


def _pick_ports(n):
    """Returns `n` distinct free loopback ports."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def parse_tf_config(text):
    """Parses and validates a `TF_CONFIG` JSON string.

    Returns `(cluster_spec_dict, task_type, task_index)`. Raises `ValueError`
    quoting what is wrong: bad JSON, an unknown role, an index out of range,
    or a cluster with no `ps` or no `worker` job.
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {text!r}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ValueError(f'TF_CONFIG needs a "cluster" object: {text!r}')
    cluster = config["cluster"]
    for job, addresses in cluster.items():
        if job not in ROLES:
            raise ValueError(
                f"TF_CONFIG cluster has unknown job {job!r}; expected some of {ROLES}."
            )
        if not isinstance(addresses, list) or not all(
            isinstance(a, str) and ":" in a for a in addresses
        ):
            raise ValueError(
                f"TF_CONFIG cluster job {job!r} must be a list of 'host:port' "
                f"strings, got {addresses!r}."
            )
    validate_cluster_spec(cluster)
    task = config.get("task")
    if not isinstance(task, dict):
        raise ValueError(f'TF_CONFIG needs a "task" object: {text!r}')
    task_type, task_index = task.get("type"), task.get("index", 0)
    if task_type not in ROLES:
        raise ValueError(
            f"TF_CONFIG task type {task_type!r} is not one of {ROLES}."
        )
    if task_type != "evaluator":
        n = len(cluster.get(task_type, []))
        if not isinstance(task_index, int) or not 0 <= task_index < n:
            raise ValueError(
                f"TF_CONFIG task index {task_index!r} is out of range for job "
                f"{task_type!r}, which has {n} task(s)."
            )
    return cluster, task_type, task_index


def validate_cluster_spec(cluster):
    """Raises `ValueError` unless `cluster` has at least one ps and one worker."""
    for job in ("ps", "worker"):
        if not cluster.get(job):
            raise ValueError(
                f"The cluster has no {job!r} task; asynchronous parameter-server "
                f"training needs at least one ps and one worker. Cluster: {cluster}"
            )


def make_resolver(cluster, task_type="chief", task_index=0):
    """A `SimpleClusterResolver` for a cluster dict, from the chief's view."""
    import tensorflow as tf

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster),
        task_type=task_type,
        task_id=task_index,
        rpc_layer="grpc",
    )


class LocalCluster:
    """N workers and M parameter servers on loopback, as child processes.

    Args:
        num_workers: worker tasks.
        num_ps: parameter-server tasks.
        shared_process: host all tasks in one child process (cheap: one
            TensorFlow import for many emulated workers) instead of one
            process per task (tasks can then be killed one by one).
        gpus_per_worker: GPUs given to each worker process through
            `CUDA_VISIBLE_DEVICES`; 0 hides all GPUs. PS tasks never see a GPU.
        start_timeout: seconds to wait for the servers to come up.
    """

    def __init__(
        self,
        num_workers=2,
        num_ps=1,
        shared_process=False,
        gpus_per_worker=0,
        start_timeout=120.0,
    ):
        if num_workers < 1 or num_ps < 1:
            raise ValueError(
                "A LocalCluster needs at least one worker and one ps, got "
                f"num_workers={num_workers}, num_ps={num_ps}."
            )
        self.num_workers, self.num_ps = num_workers, num_ps
        self.shared_process = shared_process
        self.gpus_per_worker = gpus_per_worker
        self._procs = {}  # "job:index" -> Popen; a shared host is "all"
        self._lock = threading.Lock()
        ports = _pick_ports(num_workers + num_ps + 1)
        self.cluster_spec = {
            "chief": [f"localhost:{ports[0]}"],
            "worker": [f"localhost:{p}" for p in ports[1 : 1 + num_workers]],
            "ps": [f"localhost:{p}" for p in ports[1 + num_workers :]],
        }
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
        """
        return make_resolver(dict(self.cluster_spec, chief=[f"localhost:{_pick_ports(1)[0]}"]))

    def tasks(self):
        return [f"ps:{i}" for i in range(self.num_ps)] + [
            f"worker:{i}" for i in range(self.num_workers)
        ]

    def _env_for(self, tasks):
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        workers = [int(t.split(":")[1]) for t in tasks if t.startswith("worker")]
        if self.gpus_per_worker and len(workers) == 1 and len(tasks) == 1:
            first = workers[0] * self.gpus_per_worker
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(first + i) for i in range(self.gpus_per_worker)
            )
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def _spawn(self, tasks):
        cmd = [
            sys.executable,
            "-m",
            "tf_asgd.task_server",
            json.dumps(self.cluster_spec),
            ",".join(tasks),
        ]
        return subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self._env_for(tasks),
            text=True,
        )

    def _start(self, timeout):
        groups = [self.tasks()] if self.shared_process else [[t] for t in self.tasks()]
        for group in groups:
            self._procs["all" if self.shared_process else group[0]] = self._spawn(group)
        deadline = time.time() + timeout
        for name, proc in self._procs.items():
            self._wait_ready(name, proc, deadline)

    def _wait_ready(self, name, proc, deadline):
        result = {}

        def read():
            for line in proc.stdout:
                if line.strip() == _READY:
                    result["ok"] = True
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.time()))
        if not result.get("ok"):
            code = proc.poll()
            raise RuntimeError(
                f"TF server task {name} did not start "
                + (f"(exit code {code})." if code is not None else "in time.")
            )

    def restart_task(self, task, timeout=120.0):
        """Starts a killed task again on its old port (process mode only)."""
        if self.shared_process:
            raise ValueError("restart_task needs shared_process=False.")
        self.kill_task(task)
        proc = self._spawn([task])
        self._procs[task] = proc
        self._wait_ready(task, proc, time.time() + timeout)

    def kill_task(self, task, sig=signal.SIGKILL):
        """Kills one task's process (for fault injection)."""
        proc = self._procs.get(task)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(timeout=30)

    def pids(self):
        return {t: p.pid for t, p in self._procs.items() if p.poll() is None}

    def close(self):
        """Stops every task. Safe to call more than once."""
        with self._lock:
            procs, self._procs = list(self._procs.values()), {}
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
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
