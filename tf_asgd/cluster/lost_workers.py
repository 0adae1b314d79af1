"""A bounded wait for workers lost during training or evaluation on the workers.

TF's coordinator reconnects after a worker failure by waiting, without a bound, for every
task; with every worker waiting, `fit` would hang. `ReconnectionWatch` gates that
reconnection (`internals.gate_reconnection`): it lets TF reconnect once every task answers
(`connect.probe`), logs the unanswered tasks meanwhile, and after the strategy's
`connect_timeout` fails the waiting closures with `connect.WorkersLostError`, so `fit` and
`evaluate` raise it. When the coordinator stops, TF's threads end instead of reconnecting.
How, and what it cannot bound: docs/architecture.md.
"""

import atexit
import concurrent.futures
import logging
import threading
import time
import weakref

from tf_asgd import internals
from tf_asgd.cluster import connect

log = logging.getLogger("tf_asgd")

_POLL_SECS = 0.25  # between probe rounds while TF waits to reconnect
_RELEASE_SECS = 3.0  # at most, for a watch and the worker threads it lets go to end
_watches = weakref.WeakSet()  # every ReconnectionWatch of this process


@atexit.register
def _release_at_exit():
    # A watch holds the failure handler's lock, which the coordinator's
    # destructor (run while the interpreter shuts down) needs, and a thread
    # then never runs again: every watch ends first.
    for watch in list(_watches):
        watch.release()


class ReconnectionWatch:
    """Gates the reconnections of one strategy's coordinator (see the module
    docstring). Built by `AsyncParameterServerStrategy`; holds the strategy
    and the coordinator weakly.

    Args:
        strategy: the `AsyncParameterServerStrategy`; its `connect_timeout`
            is read at each wait.
        coordinator: its `ClusterCoordinator`.
        cluster: the cluster dict (`ClusterSpec.as_dict()`).
    """

    def __init__(self, strategy, coordinator, cluster):
        self._strategy = weakref.ref(strategy)
        self._cluster = weakref.ref(internals.coordinator_cluster(coordinator))
        self._timeout = strategy.connect_timeout
        self.tasks = connect.tasks_to_reach(cluster)  # every task TF reconnects to
        self.num_workers = sum(job == "worker" for job, _, _ in self.tasks)
        self.lost = None  # the last WorkersLostError raised, if any
        self._gating = False  # whether the failure handler's thread is in `_gate`
        self._releasing = threading.Event()  # set: the coordinator stops, gates end
        self.gated = internals.gate_reconnection(coordinator, self._gate)
        internals.keep_worker_threads(coordinator)  # a PS lost in a worker's recovery
        if self.gated:
            internals.order_coordinator_stop(coordinator, self.release)
            _watches.add(self)
        else:
            log.warning(
                "TF's coordinator has an unknown failure handler: a worker that does "
                "not come back is waited for without a bound."
            )

    def release(self):
        """Ends the watch for good (the coordinator stops): a gate running
        returns, and the worker threads that waited for the reconnection end
        (each within `_RELEASE_SECS`)."""
        self._releasing.set()
        deadline = time.monotonic() + _RELEASE_SECS
        released = self._gating
        while self._gating and time.monotonic() < deadline:
            time.sleep(0.02)
        cluster = self._cluster()
        while (
            released
            and cluster is not None
            and time.monotonic() < deadline
            and internals.workers_awaiting_reconnection(cluster)
        ):
            time.sleep(0.02)

    def _gate(self):
        """True: TF may reconnect (every task answers); False: the coordinator
        stops, TF must not reconnect (its worker threads are told to end)."""
        self._gating = True
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(32, len(self.tasks)), thread_name_prefix="tf_asgd_probe"
        )
        try:
            return self._wait_for_tasks(pool)
        except Exception:  # a bug here must not stop TF's thread
            log.exception("Waiting for the lost cluster tasks failed; reconnecting as TF does.")
            return True
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            self._gating = False

    def _stopping(self):
        cluster = self._cluster()
        if cluster is None:
            return True
        if self._releasing.is_set() or internals.coordinator_stopping(cluster):
            internals.stop_worker_threads(cluster)
            return True
        return False

    def _wait_for_tasks(self, pool):
        start = time.monotonic()
        stalled_since = None  # since when no worker can run
        pace, last_down = None, None  # pace: when the stall logs (connect.WaitLog)
        while True:
            if self._stopping():
                return False
            down = connect.unanswered(self.tasks, pool)
            now = time.monotonic()
            if not down:
                if last_down is not None:
                    log.warning(
                        "All %d cluster task(s) answer again after %.1f s; reconnecting.",
                        len(self.tasks),
                        now - start,
                    )
                return True
            cluster = self._cluster()
            if cluster is None:
                return False
            waiting = internals.workers_awaiting_reconnection(cluster)
            named = ", ".join(f"{j}:{i} at {a} ({r})" for (j, i, a), r in down.items())
            if len(waiting) < self.num_workers:  # a worker still runs closures
                stalled_since, pace = None, None
                if set(down) != last_down:
                    log.warning(
                        "Lost %d cluster task(s): %s. Training goes on on the other "
                        "workers; TF reconnects once every task answers.",
                        len(down),
                        named,
                    )
            else:
                stalled_since = stalled_since or now
                pace = pace or connect.WaitLog()
                timeout = self._current_timeout()
                if now - stalled_since >= timeout:
                    self._give_up(cluster, down, timeout)
                elif pace.due(now):
                    log.warning(
                        "No worker can run: waiting at most %g s (%.0f s so far) for "
                        "%d cluster task(s) to answer: %s",
                        timeout,
                        now - stalled_since,
                        len(down),
                        named,
                    )
            last_down = set(down)
            del cluster
            self._releasing.wait(_POLL_SECS)

    def _current_timeout(self):
        strategy = self._strategy()
        if strategy is not None:
            self._timeout = strategy.connect_timeout
        return self._timeout

    def _give_up(self, cluster, down, timeout):
        """Fails the closures waiting for a worker with a `WorkersLostError`."""
        error = connect.WorkersLostError(
            [(*task, reason) for task, reason in down.items()], timeout
        )
        failed = internals.fail_waiting_closures(cluster, error)
        if failed:
            self.lost = error
            log.error(
                "Gave up waiting for %s after %g s: %d closure(s) failed with WorkersLostError.",
                ", ".join(f"{j}:{i} at {a}" for j, i, a, _ in error.tasks),
                timeout,
                failed,
            )
