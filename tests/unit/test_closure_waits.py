"""`internals.wait_for_queue` holds its timeout where TF's `ClosureQueue.wait` does not:
once a closure has failed, TF's wait cancels the rest and then waits, with no timeout,
for every closure still in flight (a worker's stays in flight until TF reconnects to
it). Driven on TF's own closure queue."""

import threading
import time
import types

from tensorflow.python.distribute.coordinator import cluster_coordinator

from tf_asgd import internals


def _closure():
    return types.SimpleNamespace(tag=None, mark_cancelled=lambda: None)


def _queue_with_a_failure_and_one_in_flight():
    closures = cluster_coordinator._CoordinatedClosureQueue()
    for _ in range(2):
        closures.put(_closure())
    closures.get(), closures.get()  # both in flight, on two workers
    closures.mark_failed(ValueError("a window failed"))  # one fails; one stays in flight
    return closures


def test_the_wait_ends_at_its_timeout_with_a_closure_in_flight_after_a_failure():
    closures = _queue_with_a_failure_and_one_in_flight()
    start = time.monotonic()
    assert internals.wait_for_queue(closures, 0.5) is False
    assert time.monotonic() - start < 2.0
    assert closures._error is not None  # still raised once, by the next wait or schedule


def test_tf_own_wait_does_not_end_at_its_timeout_there():
    # Why the bounded wait exists: TF's wait is still blocked 2 s past its timeout.
    closures = _queue_with_a_failure_and_one_in_flight()
    done = threading.Event()

    def wait():
        try:
            closures.wait(timeout=0.5)
        except ValueError:
            pass
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    assert not done.wait(2.5)
    closures.mark_finished()  # the closure in flight ends: TF's wait returns
    assert done.wait(5.0)


def test_the_error_is_swallowed_once_nothing_is_in_flight():
    closures = _queue_with_a_failure_and_one_in_flight()
    finisher = threading.Timer(0.3, closures.mark_finished)
    finisher.start()
    start = time.monotonic()
    assert internals.wait_for_queue(closures, 5.0) is True
    assert time.monotonic() - start < 3.0
    assert closures._error is None
    assert closures.done()


def test_an_idle_queue_returns_at_once():
    closures = cluster_coordinator._CoordinatedClosureQueue()
    assert internals.wait_for_queue(closures, 0.0) is True
