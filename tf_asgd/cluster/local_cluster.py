"""Clusters: `TF_CONFIG` parsing and local loopback clusters of TF servers.

A `LocalCluster` starts parameter-server and worker tasks as child processes bound to
loopback ports, and always stops them: on `close()`, on leaving its `with` block (also on
an exception or Ctrl-C), at interpreter exit, and, through a stdin lifeline, when the
parent process dies.

Example:
    with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
"""

import atexit
import contextlib
import ctypes
import gc
import importlib.abc
import importlib.machinery
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tf_asgd.cluster import network, task_forks

READY = "TF_ASGD_READY"  # printed by tf_asgd.cluster.task_server once it listens

ROLES = ("chief", "worker", "ps", "evaluator")

# "1": processes started by tf_asgd show TensorFlow's start-up logs (the
# launcher's --verbose_tf sets it); otherwise they start quietly.
VERBOSE_TF_ENV = "TF_ASGD_VERBOSE_TF"

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


# What every TF 2.21 process writes to stderr while it starts (absl's
# pre-initialisation notice, the oneDNN and CPU-feature notes: written before
# absl's log is set up, so TF_CPP_MIN_LOG_LEVEL does not hide them), the
# chief's own gRPC server's address when it connects, and, on a machine
# without a CUDA driver, the failed GPU probe. Nothing else is dropped.
_STARTUP_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called|"
    r"port\.cc:\d+\] oneDNN custom operations are on|"
    r"grpc_server_lib\.cc:\d+\] Started server with target: |"
    r"cudart_stub\.cc:\d+\] Could not find cuda drivers|"
    r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized|"
    r"^To enable the following instructions: .* rebuild TensorFlow"
)
_FAILED_CUINIT = re.compile(r"cuda_platform\.cc:\d+\] failed call to cuInit")

# Runs a module (argv[1]) with TensorFlow imported and its devices listed
# while native stderr goes to a file, then shows that output without the
# start-up noise (`startup_log_to_show`); on a failure, all of it.
_QUIET_BOOT = "exec(%r)" % (  # one line (`ps` shows lines)
    "import os,sys,tempfile,runpy\n"
    "f=tempfile.TemporaryFile();e=os.dup(2);os.dup2(f.fileno(),2);ok=False\n"
    "try:\n"
    " import tf_asgd.cluster.local_cluster as c\n"
    " c.boot_tensorflow(sys.argv[1:]);ok=True\n"
    "finally:\n"
    " os.dup2(e,2);os.close(e);f.seek(0);t=f.read().decode(errors='replace');f.close()\n"
    " sys.stderr.write(c.startup_log_to_show(t) if ok else t);sys.stderr.flush()\n"
    "sys.argv=sys.argv[1:];runpy.run_module(sys.argv[0],run_name='__main__',alter_sys=True)\n"
)


_TASK_SERVER = "tf_asgd.cluster.task_server"

# Processes that only serve TF graphs: TensorFlow starts there without Keras.
SERVER_MODULES = (_TASK_SERVER,)


class _NoKeras(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `keras` where it is installed (TF looks up its directory) but
    refuses to load it (TF then skips its eager import of Keras)."""

    def find_spec(self, name, path, target=None):
        if name != "keras":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = self
        return spec

    def create_module(self, spec):
        raise ImportError("Keras is not loaded in a process that only serves TF graphs")

    def exec_module(self, module):
        raise ImportError("Keras is not loaded in a process that only serves TF graphs")


def import_tensorflow(module=None):
    """Imports and returns TensorFlow for a process that runs `module`.

    For a task server (`SERVER_MODULES`), without Keras: TF imports Keras's
    optimizers eagerly, to register them for SavedModel loading, which a
    server never does; that import is about a third of a task's start-up CPU.
    Where Keras or TF is loaded already, this only imports TF.
    """
    if module not in SERVER_MODULES or "keras" in sys.modules or "tensorflow" in sys.modules:
        import tensorflow

        return tensorflow
    blocker = _NoKeras()
    sys.meta_path.insert(0, blocker)
    try:
        import tensorflow
    finally:
        sys.meta_path.remove(blocker)
    return tensorflow


def boot_tensorflow(argv):
    """What a quiet start runs before the module `argv[0]`: imports TensorFlow
    and lists its devices (which loads the GPU libraries) while stderr is muted.
    A fork server (`task_forks`) lists none: CUDA is not fork-safe once
    initialised, and each task it forks lists its own."""
    tf = import_tensorflow(argv[0])
    if task_forks.FORKS not in argv:
        tf.config.list_physical_devices()


def verbose_tf():
    """Whether TF's start-up logs are wanted (`VERBOSE_TF_ENV` is "1")."""
    return os.environ.get(VERBOSE_TF_ENV) == "1"


def python_command(module, args=()):
    """`python -m module args`, started quietly unless `verbose_tf()`: TF's
    start-up lines are dropped (`startup_log_to_show`), all else is shown."""
    if verbose_tf():
        return [sys.executable, "-m", module, *args]
    # The module's name first, so that a narrow `ps` shows it, as with `-m`.
    return [sys.executable, "-c", f"{module!r};{_QUIET_BOOT}", module, *args]


def startup_log_to_show(text):
    """`text` (what native code wrote to stderr while TF started) without the
    start-up noise. A failed cuInit is noise only where there is no CUDA
    driver (no GPU could be used anyway); with a driver it is shown."""
    no_driver = not _cuda_driver_present()
    kept = [
        line
        for line in text.splitlines(keepends=True)
        if not _STARTUP_NOISE.search(line) and not (no_driver and _FAILED_CUINIT.search(line))
    ]
    return "".join(kept)


def _cuda_driver_present():
    """Whether the CUDA driver library (libcuda) can be loaded."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def quiet_tf_startup(enabled=True):
    """While the block runs (import TensorFlow, list its devices), what native
    code writes to stderr (fd 2) goes to a file; afterwards it is written to
    stderr without the start-up noise (everything, if the block raised)."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()  # what Python wrote meanwhile goes to the file too
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            sys.stderr.write(startup_log_to_show(text) if ok else text)
            sys.stderr.flush()


# Copies stdin to stderr line by line, without the lines matching argv[1].
_FILTER = (
    "import re,sys\n"
    "p=re.compile(sys.argv[1],re.M)\n"
    "for line in sys.stdin.buffer:\n"
    " t=line.decode(errors='replace')\n"
    " if not p.search(t):sys.stderr.write(t);sys.stderr.flush()\n"
)


@contextlib.contextmanager
def filtered_stderr():
    """While the block runs, native stderr (fd 2) passes through a filter process that
    drops TF's start-up lines (`_STARTUP_NOISE`) and shows every other line as it comes.

    The filter is a separate process, so a fatal message (TF aborting at import on a CPU
    it was not built for) still reaches the terminal: the filter reads to the end of the
    pipe even after this process is gone. Where the filter cannot start, nothing is
    filtered.
    """
    sys.stderr.flush()
    try:
        filt = subprocess.Popen(
            [sys.executable, "-S", "-c", _FILTER, _STARTUP_NOISE.pattern], stdin=subprocess.PIPE
        )
    except OSError:
        yield
        return
    saved = os.dup(2)
    os.dup2(filt.stdin.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        filt.stdin.close()
        try:
            filt.wait(timeout=10)
        except subprocess.TimeoutExpired:
            filt.kill()
            filt.wait()


def _mark_gone(addresses, gone=True):
    """Tells this process's TF client that the tasks at `addresses` stopped
    (or, `gone=False`, are back): a tf.function freed while it is connected
    to them is then not removed from the cluster, one synchronous RPC per
    task, each an error logged for a task that is gone (see
    `internals.mark_tasks_gone`). Nothing to do if TF was never imported."""
    if "tensorflow" in sys.modules:
        from tf_asgd import internals

        internals.mark_tasks_gone(addresses, gone)


def _pick_ports(n):
    """Returns `n` distinct free ports, below the kernel's ephemeral range where it can.

    Outgoing connections take their source ports from the ephemeral range. A task's
    port there can be taken while the task is down, by another connection or by a
    client's retries to that port connecting to themselves (TCP simultaneous open),
    and the task then cannot restart on it.
    """
    low = _ephemeral_range_start()
    first = max(1024, low // 2)
    if low - first < 64 * n:  # no room below the range: any port the kernel gives
        candidates = [0] * n
    else:
        candidates = random.SystemRandom().sample(range(first, low), min(low - first, 256 * n))
    socks, ports = [], []
    try:
        for candidate in candidates:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("", candidate))  # TF's servers listen on every address
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(s.getsockname()[1])
            if len(ports) == n:
                return ports
    finally:
        for s in socks:
            s.close()
    raise RuntimeError(f"no {n} free ports between {first} and {low}.")


def _ephemeral_range_start():
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def parse_tf_config(text):
    """Parses and validates a `TF_CONFIG` JSON string.

    Args:
        text: the JSON text, `{"cluster": {job: ["host:port", ...]}, "task":
            {"type": job, "index": i}}`, with jobs among "chief", "worker",
            "ps" and "evaluator". A missing task index means 0; the
            evaluator's is not checked (it is no task of the cluster).

    Returns:
        `(cluster, task_type, task_index)`: the cluster dict as given, the
        task's job and its index.

    Raises:
        ValueError: quoting what is wrong: bad JSON, no "cluster" or "task"
            object, an unknown job, addresses that are not "host:port"
            strings, an index out of range, or a cluster with no `ps` or no
            `worker` task.

    Examples:
        >>> cluster, task_type, index = parse_tf_config(
        ...     '{"cluster": {"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]},'
        ...     ' "task": {"type": "worker", "index": 1}}'
        ... )
        >>> task_type, index, cluster["ps"]
        ('worker', 1, ['p0:2222'])
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
        raise ValueError(f"TF_CONFIG task type {task_type!r} is not one of {ROLES}.")
    if task_type != "evaluator":
        n = len(cluster.get(task_type, []))
        if not isinstance(task_index, int) or not 0 <= task_index < n:
            raise ValueError(
                f"TF_CONFIG task index {task_index!r} is out of range for job "
                f"{task_type!r}, which has {n} task(s)."
            )
    return cluster, task_type, task_index


def tf_config_role(environ=None):
    """`(cluster, task_type, task_index)` from `TF_CONFIG`, or `None` when unset.

    Raises `ValueError` quoting what is wrong with a malformed `TF_CONFIG`
    (bad JSON, unknown role, index out of range, no ps or worker, no chief).
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    cluster, task_type, task_index = parse_tf_config(text)
    chiefs = cluster.get("chief", [])
    if len(chiefs) != 1:
        raise ValueError(
            "TF_CONFIG cluster needs exactly one 'chief' task (it runs the "
            f"coordinator and the training loop), got {chiefs!r} in: {text!r}"
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
    return python_command(_TASK_SERVER, [task_forks.FORKS]), _task_env([], 0)


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
        self._lock = threading.Lock()
        ports = _pick_ports(num_workers + num_ps + 1)
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
        return make_resolver(dict(self.cluster_spec, chief=[f"localhost:{_pick_ports(1)[0]}"]))

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
            python_command(_TASK_SERVER, [json.dumps(self.cluster_spec), ",".join(tasks)]),
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
            task: a name from `tasks()`, e.g. "worker:1".
            timeout: seconds to wait for the new server to listen.

        Raises:
            ValueError: the cluster was made with `shared_process=True` (its
                tasks cannot be restarted one by one).
            RuntimeError: the task did not start within `timeout`.
        """
        if self.shared_process:
            raise ValueError("restart_task needs shared_process=False.")
        self.kill_task(task)
        _mark_gone(self._addresses([task]), gone=False)
        proc = self._spawn([task], time.time() + timeout)
        self._procs[task] = proc
        self._wait_ready(task, proc, time.time() + timeout)

    def kill_task(self, task, sig=signal.SIGKILL):
        """Kills one task's process (for fault injection) and waits for it to exit.

        Nothing happens for a task that is not running, or a name this
        cluster does not have.

        Args:
            task: a name from `tasks()`, e.g. "worker:1"; with
                `shared_process=True`, "all" (the one process hosting every task).
            sig: the signal sent; `SIGKILL` by default, as a crash would.
        """
        proc = self._procs.get(task)
        if proc is not None and proc.poll() is None:
            _mark_gone(self._addresses(self.tasks() if task == "all" else [task]))
            proc.send_signal(sig)
            proc.wait(timeout=30)

    def _addresses(self, tasks):
        return [self.cluster_spec[t.split(":")[0]][int(t.split(":")[1])] for t in tasks]

    def pids(self):
        """The process id of each running task process.

        Returns:
            A dict `{task name: pid}` ("all" for the shared process), without
            the tasks that were killed or have exited.
        """
        return {t: p.pid for t, p in self._procs.items() if p.poll() is None}

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
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
