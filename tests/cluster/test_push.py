"""The PS side of a push (`runtime/push.py`) on real loopback clusters: the staleness rule
applied exactly, variables and shards spread over two PS, and an update that reaches the
central variables whole or not at all."""

import signal
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd.rules import outer_optimizers, staleness
from tf_asgd.runtime import scheduling

from helpers import compile_digits


def _strategy(cluster, **kwargs):
    return tf_asgd.AsyncParameterServerStrategy(cluster.resolver, **kwargs)


@pytest.mark.parametrize("rule,max_staleness", [("dynsgd", None), ("none", None), ("dynsgd", 1)])
def test_ps_rule_is_exact(cluster, rule, max_staleness):
    """Known updates pushed with known pulled versions: the central variables
    and counters follow staleness.apply_push to float tolerance."""
    strategy = _strategy(cluster, n_sync=1, staleness=rule, max_staleness=max_staleness)
    init = np.arange(6, dtype="float32").reshape(2, 3)
    with strategy.scope():
        var = tf.Variable(init)
    rng = np.random.default_rng(1)
    updates = rng.normal(size=(5, 2, 3)).astype("float32")
    pulled = [0, 0, 0, 1, 4]  # tickets are taken in order: tau = i - pulled

    @tf.function
    def push(update, pulled_version):
        central = scheduling.CentralVariables([var], strategy.counters, rule, max_staleness)
        ops, tau = central.push([update], pulled_version)
        with tf.control_dependencies(ops):
            return tf.identity(tau)

    expected = init.copy()
    for i, (u, p) in enumerate(zip(updates, pulled)):
        tau = strategy.coordinator.schedule(push, args=(tf.constant(u), tf.constant(p, tf.int64)))
        strategy.coordinator.join()  # one push at a time: a fixed ticket order
        assert int(tau.fetch()) == i - p
        expected = staleness.apply_push(
            expected, u, tau=i - p, rule=rule, max_staleness=max_staleness
        )
    np.testing.assert_allclose(var.numpy(), expected, rtol=1e-6, atol=1e-6)

    stats = strategy.stats()
    taus = [i - p for i, p in enumerate(pulled)]
    assert stats.windows == 5
    assert stats.mean_staleness == pytest.approx(np.mean(taus))
    assert stats.max_staleness == max(taus)
    assert stats.dropped_stale == sum(staleness.is_dropped(t, max_staleness) for t in taus)


@pytest.mark.parametrize("partitioned", [False, True])
def test_variables_sharded_over_two_ps(local_cluster, digits, partitioned):
    """Two PS: whole variables round-robin, or split by a partitioner; pushes
    are scaled and applied on the PS that holds each shard."""
    (x, y), (xt, yt) = digits
    partitioner = (
        tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=1024, max_shards=2
        )
        if partitioned
        else None
    )
    with local_cluster(2, 2, own=True, shared_process=True) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver, n_sync=10, variable_partitioner=partitioner
        )
        with strategy.scope():
            model = compile_digits(tf_asgd.models.digits_convnet())
        shards = [s for v in model.variables for s in getattr(v.value, "variables", [v.value])]
        assert {s.device.split("/device")[0] for s in shards} == {
            "/job:ps/replica:0/task:0",
            "/job:ps/replica:0/task:1",
        }
        assert (len(shards) > len(model.variables)) == partitioned
        model.fit(x, y, batch_size=32, epochs=8, verbose=0)
        # Trains (the accuracy bar of record is the single-PS test's 0.95).
        assert model.evaluate(xt, yt, verbose=0)[1] >= 0.9


@pytest.mark.usefixtures("hang_guard")  # a hang fails the test, not the suite (conftest.py)
@pytest.mark.parametrize(
    "outer_opt",
    [None, outer_optimizers.OuterSGD(0.5, momentum=0.9, nesterov=True)],
    ids=["add", "outer_nesterov"],
)
def test_a_worker_killed_while_its_update_is_in_transit_leaves_the_ps_untouched(
    local_cluster, outer_opt
):
    """A push writes nothing until every piece of the update is on the PS.
    Here variable `a`'s update is ready at once and `b`'s only after the
    worker waits 8 s for its data; the worker is killed during that wait.
    Neither variable, nor the version counter, nor the outer optimizer's
    state has changed; once the worker is back, TF's coordinator runs the
    closure again and the whole update lands exactly once."""
    from tf_asgd.rules import outer
    from tf_asgd.runtime import scheduling

    with local_cluster(1, 1, own=True, shared_process=False) as cluster:
        # Its only worker is down until restarted (up to 25 s on a loaded machine): a
        # connect_timeout well above that, so the closure is waited for, not failed.
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver, n_sync=1, staleness="none", connect_timeout=120
        )
        opt = outer_opt or outer_optimizers.OuterSGD()
        with strategy.scope():
            a, b = tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([3]))
            slots = [[outer.create_slots(opt, a)], [outer.create_slots(opt, b)]]
        slow = (
            tf.data.Dataset.from_tensors(tf.ones([3]))
            .repeat()
            .apply(tf_asgd.data.sleep_transformation(8_000_000))
        )
        iterator = iter(strategy.coordinator.create_per_worker_dataset(slow))

        @tf.function
        def push(iterator):
            central = scheduling.CentralVariables(
                [a, b], strategy.counters, "none", None, opt, slots
            )
            ops, tau = central.push([tf.ones([3]), next(iterator)], tf.constant(0, tf.int64))
            with tf.control_dependencies(ops):
                return tf.identity(tau)

        result = strategy.coordinator.schedule(push, args=(iterator,))
        time.sleep(2.0)  # a's piece could have been written by now; b's is not there yet
        np.testing.assert_array_equal(b.numpy(), np.zeros(3))
        np.testing.assert_array_equal(a.numpy(), np.zeros(3))
        cluster.kill_task("worker:0", signal.SIGKILL)
        np.testing.assert_array_equal(a.numpy(), np.zeros(3))
        np.testing.assert_array_equal(b.numpy(), np.zeros(3))
        assert strategy.stats().windows == 0
        cluster.restart_task("worker:0")
        strategy.coordinator.join()
        assert int(result.fetch()) == 0
        # Once: the pure rule applied to one push from zero.
        want, state = staleness.ps_push(np.zeros(3), np.ones(3), 0, 0, {}, "none", outer=opt)
        for v, s in zip((a, b), slots):
            np.testing.assert_allclose(v.numpy(), want, rtol=1e-6)
            for name, slot in s[0].items():
                np.testing.assert_allclose(slot.numpy(), state[name], rtol=1e-6)
        assert strategy.stats().windows == 1
