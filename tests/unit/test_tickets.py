"""Version tickets taken at once by many pushes are each taken once
(`counters.PushCounters.take_ticket`). On the PS, pushes from different workers run
concurrently; here threads calling one `tf.function` do the same in one process."""

import collections
import threading

import numpy as np
import tensorflow as tf

from tf_asgd.runtime.counters import PushCounters

THREADS, TICKETS = 4, 2000


def _take_concurrently(take):
    taken = []

    def run():
        mine = [t for _ in range(TICKETS) for t in take().tolist()]
        taken.extend(mine)  # list.extend is atomic under the GIL

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return taken


def test_concurrent_pushes_take_every_ticket_once():
    """Taken with `assign_add(read_value=True)`, which reads after its add outside the
    variable's lock, 81 of these 16,000 tickets were taken twice in one run, and as many
    never."""
    counters = PushCounters()
    pushed = tf.constant(True)

    @tf.function
    def take():
        # One unconditional push and one gated push, as the two kinds of push take them.
        _, first = counters.take_ticket(tf.constant(0, tf.int64))
        _, second = counters.take_ticket(tf.constant(0, tf.int64), push=pushed)
        return tf.stack([first, second])

    take()  # traced before the threads start
    taken = _take_concurrently(lambda: take().numpy())
    twice = sorted(t for t, n in collections.Counter(taken).items() if n > 1)
    assert twice == []
    assert sorted(taken) == list(range(2, 2 + 2 * THREADS * TICKETS))
    assert int(counters.version.numpy()) == 2 + 2 * THREADS * TICKETS
    # Staleness is counted once per ticket, as the tickets were taken (pulled at 0).
    assert int(counters.staleness_sum.numpy()) == int(np.sum(np.arange(2 + 2 * THREADS * TICKETS)))


def test_a_push_not_made_takes_no_ticket():
    counters = PushCounters()

    @tf.function
    def take(push):
        return counters.take_ticket(tf.constant(0, tf.int64), push=push)

    take(tf.constant(True))
    take(tf.constant(False))
    _, ticket = take(tf.constant(True))
    assert int(ticket) == 1
    assert int(counters.version.numpy()) == 2
    assert int(counters.histogram.numpy().sum()) == 2
