"""Task processes forked from one process that imported TensorFlow once.

Importing TensorFlow is most of a task process's start-up CPU, which every
`LocalCluster` task and restart would pay. A `ForkServer` pays it once per
process and environment: a child process (`task_server --forks FD`) imports
TF, initialises no device, then forks a task process per request. The
`LocalCluster`s of a process share it (`acquire`, `release`); it stops when
the last of them closes. Each `ForkedTask` gets its own stdin lifeline and
stdout pipe, passed over a Unix socket, so it starts, reports `READY` and
stops as a task started with `subprocess.Popen` does.

A forked process cannot be waited for by its grandparent, so a task's exit is
watched through a pidfd (Linux 5.3), and its exit status is the one the fork
server reports when it reaps it.
"""

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time

FORKS = "--forks"  # task_server's argument that makes it a fork server
_NO_STATUS = 255  # a task's exit status where the fork server could not report it


def available():
    """Whether this platform can watch a forked task (pidfds, fd passing)."""
    return hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


_SHARED = {}  # (command, environment) -> [ForkServer, number of users]
# Left out of the environment's key, so that a later cluster forks from a server an earlier
# one started: variables no task reads. `ParameterServerStrategy` writes the TF two into
# os.environ when it is made; they set the coordinator's own eager client (a task started
# before the strategy, the usual order, runs without them). pytest rewrites the last at
# each phase of each test.
_VOLATILE = frozenset(
    {
        "TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE",
        "TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY",
        "PYTEST_CURRENT_TEST",
    }
)
_SHARED_LOCK = threading.Lock()


def acquire(command, env):
    """The fork server for `command` and `env`, started if none runs; each
    call needs a `release`."""
    key = (tuple(command), tuple(sorted((k, v) for k, v in env.items() if k not in _VOLATILE)))
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None or entry[0].gone:
            entry = _SHARED[key] = [ForkServer(command, env), 0]
        entry[1] += 1
        return entry[0]


def release(server):
    """Ends one `acquire` of `server`; the last one stops it."""
    with _SHARED_LOCK:
        for key, entry in list(_SHARED.items()):
            if entry[0] is server:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _SHARED[key]
    server.close()


class ForkServer:
    """A process that forks task processes on request (the module docstring).

    Args:
        command: the fork server's command line, ending in `FORKS`; the socket's
            descriptor number is appended.
        env: its environment, which every task it forks inherits.
    """

    def __init__(self, command, env):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._proc = subprocess.Popen(
                [*command, str(theirs.fileno())],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=[theirs.fileno()],
            )
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._requests = 0  # ids of the requests sent so far
        self._started = {}  # request id -> pid
        self._exited = {}  # pid -> exit status
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="tf_asgd-task-forks", daemon=True)
        self._reader.start()

    @property
    def pid(self):
        return self._proc.pid

    @property
    def gone(self):
        """Whether the fork server has exited (it forks nothing more)."""
        return self._gone or self._proc.poll() is not None

    def _read(self):
        while True:
            try:
                message = self._sock.recv(256).decode()
            except OSError:
                message = ""
            with self._cond:
                if not message:
                    self._gone = True
                elif message.startswith("started "):  # "started ID PID"
                    _, request, pid = message.split()
                    self._started[int(request)] = int(pid)
                else:  # "exited PID CODE"
                    _, pid, code = message.split()
                    self._exited[int(pid)] = int(code)
                self._cond.notify_all()
            if not message:
                return

    def spawn(self, cluster_spec, tasks, deadline):
        """Forks a process hosting `tasks` of `cluster_spec`.

        Returns:
            A `ForkedTask`.

        Raises:
            RuntimeError: the fork server is gone, or did not fork by `deadline`
                (a `time.time()`; the first request waits for its TF import).
        """
        with self._lock:
            stdin_r, stdin_w = os.pipe()
            stdout_r, stdout_w = os.pipe()
            self._requests += 1
            rid = self._requests  # a reply that comes after a timeout is not the next one's
            request = json.dumps({"id": rid, "cluster": cluster_spec, "tasks": tasks}).encode()
            try:
                socket.send_fds(self._sock, [request], [stdin_r, stdout_w])
                sent = True
            except OSError:
                sent = False
            finally:
                os.close(stdin_r)
                os.close(stdout_w)
            with self._cond:
                self._cond.wait_for(
                    lambda: rid in self._started or self._gone or not sent,
                    timeout=max(0.0, deadline - time.time()),
                )
                pid = self._started.pop(rid, None)
        if pid is None:
            os.close(stdin_w)  # a fork that comes later exits on this lifeline
            os.close(stdout_r)
            why = "in time" if sent and not self._gone else "(its fork server is gone)"
            raise RuntimeError(f"TF server task {','.join(tasks)} did not start {why}.")
        return ForkedTask(self, pid, os.fdopen(stdin_w, "w"), os.fdopen(stdout_r))

    def exit_status(self, pid, timeout=2.0):
        """`pid`'s exit status once the fork server reaped it (it reaps within
        50 ms), or `_NO_STATUS` if it did not report one within `timeout`."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exited or self._gone, timeout=timeout)
            return self._exited.pop(pid, _NO_STATUS)

    def close(self):
        """Stops the fork server (its lifeline closes); tasks it forked keep theirs."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._sock.close()
        self._reader.join(timeout=10)


class ForkedTask:
    """A task process forked by a `ForkServer`, with the part of
    `subprocess.Popen`'s interface `LocalCluster` uses: `pid`, `stdin` (the
    lifeline), `stdout`, `poll`, `wait`, `send_signal`, `terminate`, `kill`."""

    def __init__(self, server, pid, stdin, stdout):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode = None
        self._server = server
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # it already ended and was reaped
            self._pidfd = None

    def _ended(self, timeout):
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], timeout)
            if not readable:
                return False
            os.close(self._pidfd)
            self._pidfd = None
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid)
        return True

    def poll(self):
        return self.returncode if self._ended(0) else None

    def wait(self, timeout=None):
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired(f"task process {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig):
        if self._pidfd is not None:  # not yet seen to end: the pid is still this task's
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # ended meanwhile
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)
