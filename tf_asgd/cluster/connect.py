"""A bounded wait for a cluster's tasks before TensorFlow connects to them.

TF's own connection waits for every task without a bound. The strategy first waits here,
at most `connect_timeout` seconds, until every task answers as a gRPC server, logging the
tasks it still waits for; a cluster that does not answer in time raises
`ClusterUnreachableError` before TF is asked to connect. Workers lost later are
`lost_workers`' (`WorkersLostError`). Why and what it cannot bound: docs/architecture.md.

Example:
    try:
        strategy = tf_asgd.AsyncParameterServerStrategy(resolver, connect_timeout=30)
    except tf_asgd.ClusterUnreachableError as e:
        print(e)  # names each unanswering task, its address and the reason
"""

import concurrent.futures
import logging
import numbers
import socket
import threading
import time

from tf_asgd.errors import ClusterUnreachableError
from tf_asgd.errors import WorkersLostError as WorkersLostError  # lost_workers raises it

log = logging.getLogger("tf_asgd")

# A real cluster's tasks start minutes apart (pods wait for images and nodes; servers are
# started by hand over ssh): wait as long as torchrun's rendezvous does by default.
DEFAULT_CONNECT_TIMEOUT = 600.0
# While waiting: one line at once, then the interval doubles from the first to the last.
LOG_FIRST_EVERY_SECS = 5.0
LOG_EVERY_SECS = 30.0
_ATTEMPT_SECS = 1.0  # per probe: a dropped SYN (a wrong host) costs this, not the OS's minutes
_RETRY_SECS = 0.25

# What an HTTP/2 client sends first (RFC 9113, 3.4): the preface and an empty
# SETTINGS frame. A gRPC server answers with a frame of its own; its type
# byte (the 4th of the 9-byte header) is SETTINGS (4).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 4


def pause(seconds):
    """Sleeps `seconds` in a wait of Python's `threading`, where the launcher's stop
    signals may raise (`launch.run_parts.safe_to_interrupt`): a long wait for tasks
    under `fit` stays stoppable by Ctrl-C and SIGTERM."""
    threading.Event().wait(seconds)


class WaitLog:
    """When a long wait logs its next line: at once, then after intervals that
    double from `LOG_FIRST_EVERY_SECS` up to `LOG_EVERY_SECS`, so a short wait
    says what it waits for soon and a long one is not a wall of lines.

    Example:
        pace = WaitLog()
        while waiting:
            if pace.due(time.monotonic()):
                log.warning("still waiting for ...")
    """

    def __init__(self):
        self._next, self._interval, self.lines = None, LOG_FIRST_EVERY_SECS, 0

    def due(self, now):
        """True if a line is due at `now` (monotonic seconds); counts it as logged."""
        if self._next is not None and now < self._next:
            return False
        if self._next is not None:
            self._interval = min(2 * self._interval, LOG_EVERY_SECS)
        self._next, self.lines = now + self._interval, self.lines + 1
        return True


def validate_connect_timeout(value):
    """Raises unless `value` is a positive finite number of seconds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 < value < float("inf")
    ):
        raise ValueError(f"connect_timeout must be a positive number of seconds, got {value!r}.")


def address_problem(address):
    """Why `address` cannot be a task's "host:port" (a string), or None if it can.

    Only what no start-up can fix: a missing host, or a port that is not an
    integer from 1 to 65535. A host that does not resolve yet is waited for.
    """
    if not isinstance(address, str):
        return f"not a string but {type(address).__name__}"
    host, colon, port = address.rpartition(":")
    if not colon or not host.strip("[]"):
        return 'not of the form "host:port"'
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"the port {port!r} is not an integer from 1 to 65535"
    return None


def validate_addresses(tasks):
    """Raises `ValueError` naming every task (`(job, index, address)`) whose
    address cannot be right (`address_problem`): refused at once, not waited for."""
    bad = [(j, i, a, why) for j, i, a in tasks if (why := address_problem(a)) is not None]
    if bad:
        raise ValueError(
            "The cluster spec names impossible addresses: "
            + "; ".join(f"{j}:{i} {a!r} ({why})" for j, i, a, why in bad)
            + "."
        )


def tasks_to_reach(cluster):
    """`[(job, index, address)]`: the tasks of `cluster` (a dict) that the
    chief's connection dials: every ps and worker, and chief tasks other than
    `chief:0`, which TF's connection makes this process. The evaluator is no
    TF server (it reads checkpoints)."""
    return [
        (job, i, address)
        for job, addresses in sorted(cluster.items())
        if job != "evaluator"
        for i, address in enumerate(addresses)
        if (job, i) != ("chief", 0)
    ]


def probe(address, timeout=_ATTEMPT_SECS):
    """None if a gRPC (HTTP/2) server answers at `address` ("host:port")
    within `timeout` seconds, else why not (a short string)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")  # "[::1]:1234"
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except socket.timeout:
        return f"no connection in {timeout:g} s"
    except (OSError, ValueError) as e:
        return getattr(e, "strerror", None) or str(e) or type(e).__name__
    try:
        with sock:
            sock.sendall(_H2_PREFACE)
            header = _recv_exactly(sock, 9)
    except socket.timeout:
        header = None
    except OSError as e:
        return f"the connection failed: {e.strerror or e}"
    if header is None or header[3] != _H2_SETTINGS:
        return "it accepts connections but does not answer as a gRPC server"
    return None


def unanswered(tasks, pool, timeout=_ATTEMPT_SECS):
    """One round of parallel probes: `{task: reason}` of the tasks
    (`(job, index, address)`) that do not answer; a probe still running
    after `timeout` plus a second counts as no answer. `pool`: a
    `concurrent.futures.Executor` that runs the probes."""
    futures = {task: pool.submit(probe, task[2], timeout) for task in tasks}
    concurrent.futures.wait(futures.values(), timeout=timeout + 1.0)
    reasons = {}
    for task, future in futures.items():
        reason = future.result() if future.done() else f"no answer in {timeout:g} s"
        if reason is not None:
            reasons[task] = reason
    return reasons


def _recv_exactly(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def wait_for_cluster(cluster_resolver, timeout=DEFAULT_CONNECT_TIMEOUT):
    """Waits until every task the chief connects to answers.

    Args:
        cluster_resolver: a `ClusterResolver`; its `cluster_spec()` names the tasks.
        timeout: seconds to wait at most (see `validate_connect_timeout`).

    Raises:
        ValueError: `timeout` is not a positive number, or an address cannot be
            right (`address_problem`); at once, before any wait.
        ClusterUnreachableError: tasks still did not answer after `timeout`
            seconds; it names each (job, index, address, why).
    """
    validate_connect_timeout(timeout)
    tasks = tasks_to_reach(cluster_resolver.cluster_spec().as_dict())
    validate_addresses(tasks)
    wait_for_tasks(tasks, timeout)


def wait_for_tasks(tasks, timeout):
    """Probes `tasks` (`[(job, index, address)]`) until all answer, for at
    most `timeout` seconds.

    The probes run in parallel, each bounded by `_ATTEMPT_SECS`. A probe
    still running at the deadline (a host name whose lookup hangs: the
    system's resolver has its own timeout) is not waited for; it ends on its
    own.

    Raises:
        ClusterUnreachableError: naming the tasks that did not answer.
    """
    start = time.monotonic()
    deadline = start + timeout
    reasons = {task: f"no answer in {timeout:g} s" for task in tasks}  # the unanswered
    running = {}  # task -> the future of its probe
    pace = WaitLog()
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=min(32, len(tasks) or 1), thread_name_prefix="tf_asgd_probe"
    )
    try:
        while reasons:
            attempt = min(_ATTEMPT_SECS, max(0.1, deadline - time.monotonic()))
            for task in reasons:
                if task not in running:
                    running[task] = pool.submit(probe, task[2], attempt)
            concurrent.futures.wait(running.values(), timeout=max(0.0, deadline - time.monotonic()))
            for task, future in list(running.items()):
                if future.done():
                    del running[task]
                    if (reason := future.result()) is None:
                        del reasons[task]
                    else:
                        reasons[task] = reason
            now = time.monotonic()
            if reasons and now >= deadline:
                raise ClusterUnreachableError(
                    [(*task, reason) for task, reason in reasons.items()], timeout
                )
            if reasons and pace.due(now):
                log.warning(
                    "Waiting for %d of %d cluster task(s) to answer (%.0f s of at most %s s): %s",
                    len(reasons),
                    len(tasks),
                    now - start,
                    f"{timeout:.0f}" if timeout >= 10 else f"{timeout:.2g}",
                    ", ".join(f"{j}:{i} at {a} ({r})" for (j, i, a), r in reasons.items()),
                )
            if reasons:
                pause(min(_RETRY_SECS, max(0.0, deadline - now)))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if pace.lines:  # a waiting line was logged: say that the wait ended
        log.warning(
            "All %d cluster task(s) answer after %.1f s.", len(tasks), time.monotonic() - start
        )
