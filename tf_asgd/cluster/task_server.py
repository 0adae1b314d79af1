"""A process that hosts TF server tasks: `python -m tf_asgd.cluster.task_server SPEC TASKS`.

`SPEC` is the cluster as JSON, `TASKS` a comma list like `ps:0,worker:1`.
The process prints `READY` once its servers listen, then serves until its
stdin closes (the parent's lifeline) or it gets SIGTERM. TF servers cannot
be stopped in-process, so ending this process is how they stop.

`task_server --forks FD` is a fork server instead (`task_forks`): it imports
TensorFlow once, then forks one such process per request read from the
socket `FD`. `fork_server_from_here` makes one from a copy of the calling
process (the launcher's), which has imported TensorFlow already.
"""

import contextlib
import json
import os
import select
import signal
import socket
import sys
import traceback

from tf_asgd.cluster import local_cluster, task_forks, tf_startup
from tf_asgd.cluster.task_forks import FORKS


class TaskServerError(RuntimeError):
    """A task's TF server did not start (its port taken, most often)."""


def serve(cluster, tasks, announce=True):
    """Starts TF servers for `tasks` ("job:index") in this process and returns them.

    The caller keeps the process alive. With `announce`, prints `READY` (what a
    `LocalCluster` waits for on the task's stdout); the launcher's tasks do not.
    """
    tf = tf_startup.import_tensorflow("tf_asgd.cluster.task_server")

    # Tasks that share a process share its inter-op thread pool; a pool no
    # larger than the core count deadlocks when every thread blocks on a
    # Recv from a PS living in the same pool.
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=max(8, 4 * len(tasks)))
    servers = []
    for task in tasks:
        job, index = task.split(":")
        try:
            servers.append(
                tf.distribute.Server(
                    tf.train.ClusterSpec(cluster),
                    job_name=job,
                    task_index=int(index),
                    protocol="grpc",
                    config=config,
                    start=True,
                )
            )
        except tf.errors.UnknownError as e:  # TF names neither the task nor the cause
            address = cluster[job][int(index)]
            raise TaskServerError(
                f"Could not start the TF server of {task} at {address}: is its port in use "
                f"(another {task} already running, or another program)? (TensorFlow said: "
                f"{e.message.splitlines()[0]})"
            ) from e
    if announce:
        print(local_cluster.READY, flush=True)
    return servers


def _host(cluster, tasks):
    # Exit when the parent goes away (stdin EOF) or is asked to (SIGTERM).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # Held, not used: the servers run while they are referenced.
    _servers = serve(cluster, tasks)
    sys.stdin.read()
    os._exit(0)  # the servers end with the process (TF cannot stop them)


def serve_forks(sock):
    """Forks a task process per request on `sock` until stdin (the lifeline)
    closes. Each request carries the task's stdin and stdout pipes; the reply
    is `started ID PID` (ID: the request's), and `exited PID CODE` follows when
    the task ends."""
    tf_startup.import_tensorflow("tf_asgd.cluster.task_server")  # a no-op if imported
    # A Ctrl-C in the terminal reaches the whole process group: the tasks
    # stop on it as before, this process on its lifeline.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        ready, _, _ = select.select([sys.stdin, sock], [], [], 0.05)
        _report_exits(sock)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1 << 16):
            return
        if sock in ready:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
            if not message:
                return
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                _run_forked(sock, request, fds)
            for fd in fds:
                os.close(fd)
            sock.send(f"started {request['id']} {pid}".encode())


@contextlib.contextmanager
def fork_server_from_here():
    """While the block runs, this process's `LocalCluster`s without GPUs fork
    their tasks from a copy of this process made now (`task_forks.fork_here`),
    not from a new process that imports TensorFlow again.

    Enter it after importing TensorFlow and before TF starts its runtime
    (lists devices, runs an op); where pidfds are missing it does nothing.

    Example:
        import tensorflow as tf
        with task_server.fork_server_from_here():
            tf.config.list_physical_devices()
            with LocalCluster(2, 1) as cluster:
                ...

    Yields:
        The fork server's process id, or None.
    """
    if not task_forks.available():
        yield None
        return
    server = task_forks.fork_here(*local_cluster.fork_server_spec(), serve_forks)
    try:
        yield server.pid
    finally:
        task_forks.release(server)


def _report_exits(sock):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(f"exited {pid} {os.waitstatus_to_exitcode(status)}".encode())


def _run_forked(sock, request, fds):
    """In the forked child: becomes a task process on the request's pipes. Never returns."""
    try:
        sock.close()  # this process's copy
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        tf = tf_startup.import_tensorflow("tf_asgd.cluster.task_server")
        with tf_startup.quiet_tf_startup(not tf_startup.verbose_tf()):
            tf.config.list_physical_devices()
        _host(request["cluster"], request["tasks"])
    except KeyboardInterrupt:
        os._exit(130)
    except BaseException:
        traceback.print_exc()
    os._exit(1)


def _main(argv):
    if argv[1] == FORKS:
        with socket.socket(fileno=int(argv[2])) as sock:
            try:
                serve_forks(sock)
            except BrokenPipeError:  # the parent is gone
                pass
        os._exit(0)
    _host(json.loads(argv[1]), argv[2].split(","))


if __name__ == "__main__":
    _main(sys.argv)
