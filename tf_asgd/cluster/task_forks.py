"""Task processes forked from one process that imported TensorFlow once.

Importing TensorFlow is most of a task process's start-up CPU, which every
`LocalCluster` task and restart would pay. A `ForkServer` pays it once per
process and environment: a child process (`task_server --forks FD`, or a
copy of a process that imported TF, `fork_here`) initialises no device and
forks a task process per request. The `LocalCluster`s of a process share it
(`acquire`, `release`); it stops when the last of them closes. Each
`ForkedTask` gets its own stdin lifeline and stdout pipe, passed over a Unix
socket, so it starts, reports `READY` and stops as a task started with
`subprocess.Popen` does. Its exit is watched through a pidfd (Linux 5.3), and
its exit status is the one the fork server reports when it reaps it.
"""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

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
    return _hold(command, env, lambda: ForkServer.start(command, env))


def fork_here(command, env, serve):
    """Forks the fork server for `command` and `env` from this process, now,
    instead of starting it by `command` when `acquire` first asks for it.

    Call it after TensorFlow is imported and before it starts its runtime
    (lists devices, runs an op, starts a server): the fork server and each
    task it forks are copies of this process, which must not hold threads or
    devices of TensorFlow's. The environment of the tasks is `env`, as with
    `acquire`; the copy runs `serve(socket)` (`task_server.serve_forks`).

    Returns:
        The `ForkServer`, held once, as after an `acquire`: `release` it when
        no later cluster will need it.
    """
    return _hold(command, env, lambda: ForkServer.forked_here(env, serve))


def _hold(command, env, make):
    """One more use of the fork server for `command` and `env`; `make()` makes
    it where none runs."""
    key = (tuple(command), tuple(sorted((k, v) for k, v in env.items() if k not in _VOLATILE)))
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None or entry[0].gone:
            entry = _SHARED[key] = [make(), 0]
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

    Made by `start` (a new process) or `forked_here` (a copy of this one).

    Args:
        proc: the fork server's process: a `subprocess.Popen`, or a `_Child`.
        sock: this side of the socket it reads requests from.
    """

    @classmethod
    def start(cls, command, env):
        """Runs `command` (ending in `FORKS`; the socket's descriptor number is
        appended) with `env`, which every task it forks inherits."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            proc = subprocess.Popen(
                [*command, str(theirs.fileno())],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=[theirs.fileno()],
            )
        return cls(proc, ours)

    @classmethod
    def forked_here(cls, env, serve):
        """Forks this process into a fork server whose tasks get `env` (`fork_here`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        lifeline_r, lifeline_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            os.close(lifeline_w)
            _serve_here(serve, theirs, lifeline_r, env)
        theirs.close()
        os.close(lifeline_r)
        return cls(_Child(pid, os.fdopen(lifeline_w, "w")), ours)

    def __init__(self, proc, sock):
        self._proc = proc
        self._sock = sock
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


def _serve_here(serve, sock, lifeline, env):
    """In the child `ForkServer.forked_here` forked: `serve(sock)`, the fork
    server's loop, with `lifeline` as its stdin and `env` as its environment.
    Never returns."""
    code = 1
    try:
        # A Ctrl-C in the terminal reaches the whole process group: the tasks
        # stop on it, this process on its lifeline (as `task_server --forks`).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(lifeline, 0)
        os.close(lifeline)
        sys.stdin = open(0, closefd=False)  # the lifeline, whatever this process's stdin was
        os.environ.clear()
        os.environ.update(env)
        serve(sock)
        code = 0
    except BrokenPipeError:  # the parent is gone
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class _Child:
    """A child process this process forked, with the part of `subprocess.Popen`'s
    interface a `ForkServer` uses: `pid`, `stdin`, `poll`, `wait`, `kill`."""

    def __init__(self, pid, stdin):
        self.pid, self.stdin = pid, stdin
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (a waitpid(-1) of someone's)
                self.returncode = _NO_STATUS
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


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
