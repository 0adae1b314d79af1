"""Outer optimizers: the PS's TF ops against the pure NumPy rule, push by push."""

import numpy as np
import pytest
import tensorflow as tf

from tf_asgd.rules import outer, outer_optimizers, staleness

OPTIMIZERS = [
    outer_optimizers.OuterSGD(),
    outer_optimizers.OuterSGD(0.5),
    outer_optimizers.OuterSGD(0.7, momentum=0.9),
    outer_optimizers.OuterSGD(0.7, momentum=0.9, nesterov=True),
    outer_optimizers.OuterSGD(0.5, schedule=((6, 0.25),)),
    outer_optimizers.OuterSGD(0.5, momentum=0.5, schedule=((4, 0.1),)),
    outer_optimizers.OuterSGD(0.25, schedule=((2, 0.25), (5, 0.5))),
    outer_optimizers.default_outer_optimizer(4),
    outer_optimizers.default_outer_optimizer(8),  # a warm-up from 1/N below 2/3 of the limit
    outer_optimizers.DelayedNesterov(0.7, 0.9),
    outer_optimizers.DelayedNesterov(1.0, 0.5, delay=3),
]


@pytest.fixture
def sharded_cluster(local_cluster):
    """1 worker and 2 PS: variables split over both by a partitioner."""
    return local_cluster(1, 2)


@pytest.mark.parametrize("opt", OPTIMIZERS[1:], ids=repr)
def test_pushes_on_sharded_ps_variables_follow_the_numpy_rule(sharded_cluster, opt):
    """Known updates pushed through `push.CentralVariables.push` onto a variable split
    over 2 PS (and an unsplit one): central variables and outer state follow
    `staleness.ps_push`, and the step counter the tickets."""
    import tf_asgd
    from tf_asgd.runtime import push

    partitioner = tf.distribute.experimental.partitioners.MaxSizePartitioner(max_shard_bytes=16)
    strategy = tf_asgd.AsyncParameterServerStrategy(
        sharded_cluster.resolver, n_sync=1, staleness="dynsgd", variable_partitioner=partitioner
    )
    rng = np.random.default_rng(2)
    init = [rng.normal(size=(6, 2)).astype(np.float32), rng.normal(size=(1,)).astype(np.float32)]
    with strategy.scope():
        variables = [tf.Variable(v) for v in init]
        slots = [[outer.create_slots(opt, s) for s in push.shard_variables(v)] for v in variables]
    assert len(slots[0]) > 1  # really split

    @tf.function
    def push_once(u0, u1, pulled_version):
        central = push.CentralVariables(
            variables, strategy.counters, "dynsgd", None, opt, slots, num_workers=4
        )
        ops, tau = central.push([u0, u1], pulled_version)
        with tf.control_dependencies(ops):
            return tf.identity(tau)

    central, state = [v.copy() for v in init], [{}, {}]
    pulled = [0, 0, 1, 1, 2, 5, 6, 6]
    for ticket, p in enumerate(pulled):
        updates = [rng.normal(size=v.shape).astype(np.float32) for v in init]
        tau = strategy.coordinator.schedule(
            push_once, args=(*map(tf.constant, updates), tf.constant(p, tf.int64))
        )
        strategy.coordinator.join()  # one push at a time: a fixed ticket order
        assert int(tau.fetch()) == ticket - p
        for i in range(2):
            central[i], state[i] = staleness.ps_push(
                central[i],
                updates[i],
                ticket - p,
                ticket,
                state[i],
                "dynsgd",
                outer=opt,
                num_workers=4,
            )
    for v, c in zip(variables, central):
        np.testing.assert_allclose(
            push.read(v).numpy() if hasattr(v, "variables") else v.numpy(), c, rtol=1e-5, atol=1e-6
        )
    for var_slots, st in zip(slots, state):
        for name in opt.slots:
            got = np.concatenate([s[name].numpy() for s in var_slots], axis=0)
            np.testing.assert_allclose(got, st[name], rtol=1e-5, atol=1e-6)


def test_outer_state_round_trips_through_a_checkpoint(sharded_cluster, tmp_path):
    """The outer momentum is saved beside the model, and a checkpoint restored
    before `fit` fills a fresh strategy's slots when `fit` creates them."""
    import keras

    import tf_asgd

    (x, y), _ = tf_asgd.data.load_digits()
    opt = outer_optimizers.OuterSGD(0.7, momentum=0.9, nesterov=True)

    def build():
        strategy = tf_asgd.AsyncParameterServerStrategy(
            sharded_cluster.resolver, n_sync=5, outer_optimizer=opt
        )
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input(x.shape[1:]), keras.layers.Flatten(), keras.layers.Dense(10)]
            )
            model.compile(
                keras.optimizers.SGD(0.05),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        return strategy, model

    strategy, model = build()
    assert strategy.outer_state(model) is strategy.outer_state(model)
    assert not strategy.outer_state(model).variables  # created by the first fit
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    saved = [v.numpy() for v in strategy.outer_state(model).variables]
    # A momentum slot per trainable variable (kernel, bias), and it moved.
    assert len(saved) == 2 and all(np.abs(v).max() > 0 for v in saved)
    path = tf.train.Checkpoint(model=model, outer=strategy.outer_state(model)).save(
        str(tmp_path / "ckpt")
    )

    strategy, model = build()
    state = strategy.outer_state(model)
    tf.train.Checkpoint(model=model, outer=state).restore(path).assert_existing_objects_matched()
    model.fit(x, y, batch_size=32, epochs=1, initial_epoch=1, verbose=0)  # builds, trains nothing
    assert strategy.model_stats(model).windows == 0
    got = [v.numpy() for v in state.variables]
    assert len(got) == len(saved)
    for g, w in zip(got, saved):
        np.testing.assert_array_equal(g, w)
