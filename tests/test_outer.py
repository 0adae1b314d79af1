"""Outer optimizers: the PS's TF ops against the pure NumPy rule, push by push."""

import numpy as np
import pytest
import tensorflow as tf

from tf_asgd.rules import outer, update_rules

OPTIMIZERS = [
    update_rules.OuterSGD(),
    update_rules.OuterSGD(0.5),
    update_rules.OuterSGD(0.7, momentum=0.9),
    update_rules.OuterSGD(0.7, momentum=0.9, nesterov=True),
    update_rules.OuterSGD(0.5, schedule=((6, 0.25),)),
    update_rules.OuterSGD(0.5, momentum=0.5, schedule=((4, 0.1),)),
    update_rules.OuterSGD(0.25, schedule=((2, 0.25), (5, 0.5))),
    update_rules.default_outer_optimizer(4),
    update_rules.DelayedNesterov(0.7, 0.9),
    update_rules.DelayedNesterov(1.0, 0.5, delay=3),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_tf_ops_match_the_numpy_rule(opt):
    rng = np.random.default_rng(0)
    workers, rule = 4, "dynsgd"
    start = rng.normal(size=(5, 3)).astype(np.float32)
    var = tf.Variable(start)
    slots = outer.create_slots(opt, var)

    @tf.function
    def push(piece, scale, ticket):
        outer.apply(opt, var, piece, slots, scale, ticket, workers)

    central, state = start.copy(), {}
    for ticket in range(11):
        update = rng.normal(size=start.shape).astype(np.float32)
        tau = int(rng.integers(0, 4))
        scale = update_rules.staleness_scale(tau, rule)
        push(tf.constant(update), tf.constant(scale), tf.constant(ticket, tf.int64))
        central, state = update_rules.ps_push(
            central, update, tau, ticket, state, rule, outer=opt, num_workers=workers
        )
        np.testing.assert_allclose(var.numpy(), central, rtol=1e-5, atol=1e-6)
        for name, slot in slots.items():
            np.testing.assert_allclose(slot.numpy(), state[name], rtol=1e-5, atol=1e-6)


def test_defaults_are_the_classic_parameter_server():
    central, update = np.array([1.0, 2.0]), np.array([4.0, -4.0])
    out, state = update_rules.ps_push(central, update, 3, 7, {}, "dynsgd")
    np.testing.assert_allclose(out, [2.0, 1.0])
    assert state == {} and update_rules.OuterSGD().slots == ()


def _decays(scale, delay, steps=20000):
    """Whether `e[k+1] = e[k] - scale * e[k - delay]` decays from a constant start."""
    e = [1.0] * (delay + 1)
    for _ in range(steps):
        e.append(e[-1] - scale * e[-1 - delay])
        if abs(e[-1]) > 1e6:
            return False
    return abs(e[-1]) < 1e-3


@pytest.mark.parametrize("workers", [2, 3, 4, 8, 16])
def test_stability_limit_is_where_saturated_stale_pushes_stop_decaying(workers):
    # N workers in round-robin order: each push is N - 1 pushes stale.
    limit = update_rules.stability_limit(workers)
    assert _decays(0.95 * limit, workers - 1)
    assert not _decays(1.05 * limit, workers - 1)


def test_default_outer_learning_rate():
    # One worker: plain Keras; the average up to 4 workers; then 2/3 of the
    # stability limit, never below the average.
    got = [update_rules.default_outer_learning_rate(n) for n in (1, 2, 3, 4, 5, 8, 16, 32)]
    limit = update_rules.stability_limit
    np.testing.assert_allclose(
        got,
        [
            1.0,
            0.5,
            1 / 3,
            0.25,
            2 / 3 * limit(5),
            2 / 3 * limit(8),
            2 / 3 * limit(16),
            2 / 3 * limit(32),
        ],
    )
    for n in range(2, 101):
        rate = update_rules.default_outer_learning_rate(n)
        assert 1 / n <= rate < limit(n)


def test_default_outer_optimizer_rises_over_the_first_round_then_falls():
    # 4 workers: 1/4 rising to the stability limit over the first 4 pushes,
    # then back to 1/4 over 40.
    limit4 = update_rules.stability_limit(4)
    opt = update_rules.default_outer_optimizer(4)
    got = [update_rules.outer_learning_rate(opt, t) for t in (0, 2, 4, 24, 44, 1000)]
    expected = [0.25, (0.25 + limit4) / 2, limit4, (limit4 + 0.25) / 2, 0.25, 0.25]
    np.testing.assert_allclose(got, expected)
    # 3 workers: the peak is capped at 1/2 (two workers' sum diverged).
    opt = update_rules.default_outer_optimizer(3)
    got = [update_rules.outer_learning_rate(opt, t) for t in (0, 3, 33)]
    np.testing.assert_allclose(got, [1 / 3, 0.5, 1 / 3])
    # 8 workers: from the average up to the default over 4N pushes, no peak.
    opt = update_rules.default_outer_optimizer(8)
    got = [update_rules.outer_learning_rate(opt, t) for t in (0, 16, 32, 1000)]
    rate8 = update_rules.default_outer_learning_rate(8)
    np.testing.assert_allclose(got, [0.125, (0.125 + rate8) / 2, rate8, rate8])
    for n in range(5, 101):  # never above 2/3 of the limit from 5 workers on
        opt = update_rules.default_outer_optimizer(n)
        peak = max(update_rules.outer_learning_rate(opt, t) for t in range(0, 20 * n, n))
        assert peak <= 2 / 3 * update_rules.stability_limit(n) + 1e-12
    # Up to 2 workers the default is the average from the start.
    assert update_rules.default_outer_optimizer(1) == update_rules.OuterSGD(1.0)
    assert update_rules.default_outer_optimizer(2) == update_rules.OuterSGD(0.5)
    # The ramp is applied to the pseudo-gradient push by push.
    theta, _ = update_rules.outer_step(
        update_rules.default_outer_optimizer(4),
        np.zeros(2, np.float32),
        np.ones(2, np.float32),
        {},
        2,
        4,
    )
    assert theta.dtype == np.float32
    np.testing.assert_allclose(theta, [-(0.25 + limit4) / 2] * 2, rtol=1e-6)
    # The same rate, traced as the PS computes it.
    rates = [
        float(
            outer.effective_learning_rate(
                update_rules.default_outer_optimizer(4), 4, tf.constant(t, tf.int64)
            )
        )
        for t in (0, 2, 4, 24, 44, 1000)
    ]
    np.testing.assert_allclose(rates, expected)


def test_schedule_is_normalised_so_equal_optimizers_compare_equal():
    assert update_rules.OuterSGD(0.5, schedule=[[4, 1]]) == update_rules.OuterSGD(
        0.5, schedule=((4, 1.0),)
    )


def test_delayed_nesterov_is_diloco_over_each_group():
    # Over `delay` pushes: theta -= lr * (mean(g) + mu * v), v = mu * v + mean(g) (Nesterov).
    opt = update_rules.DelayedNesterov(0.7, 0.9, delay=2)
    theta, state = np.zeros(1), {}
    gs = [1.0, 3.0, -1.0, 5.0]
    m, ref = 0.0, 0.0
    for ticket, g in enumerate(gs):
        theta, state = update_rules.outer_step(opt, theta, np.array([g]), state, ticket, 2)
        if ticket % 2:
            mean = (gs[ticket - 1] + g) / 2
            m = 0.9 * m + mean
            ref -= 0.7 * (mean + 0.9 * m)
            np.testing.assert_allclose(theta, [ref])


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: update_rules.OuterSGD(0.0), ValueError, "learning_rate must be a number > 0"),
        (
            lambda: update_rules.OuterSGD(1.0, momentum=1.0),
            ValueError,
            r"momentum must be in \[0, 1\)",
        ),
        (lambda: update_rules.OuterSGD(1.0, nesterov=True), ValueError, "needs momentum > 0"),
        (
            lambda: update_rules.DelayedNesterov(delay=0),
            ValueError,
            "delay must be a positive integer",
        ),
        (
            lambda: update_rules.OuterSGD(1.0, schedule=((0, 0.5),)),
            ValueError,
            "pushes must be a positive integer",
        ),
        (
            lambda: update_rules.OuterSGD(1.0, schedule=((8, 0.0),)),
            ValueError,
            "schedule start_rate must be a number > 0",
        ),
        (
            lambda: update_rules.OuterSGD(1.0, schedule=(8, 0.5)),
            ValueError,
            r"sequence of \(pushes, start_rate\) pairs",
        ),
        (
            lambda: update_rules.validate_outer_optimizer("adam"),
            TypeError,
            "outer_optimizer must be",
        ),
        (
            lambda: update_rules.validate_worker_state("zero"),
            ValueError,
            "Unknown worker_state 'zero'",
        ),
    ],
)
def test_bad_outer_configuration(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.fixture(scope="module")
def sharded_cluster():
    """1 worker and 2 PS: variables split over both by a partitioner."""
    import tf_asgd

    with tf_asgd.LocalCluster(num_workers=1, num_ps=2, shared_process=True) as c:
        yield c


@pytest.mark.cluster
@pytest.mark.parametrize("opt", OPTIMIZERS[1:], ids=repr)
def test_pushes_on_sharded_ps_variables_follow_the_numpy_rule(sharded_cluster, opt):
    """Known updates pushed through `push.push_update` onto a variable split
    over 2 PS (and an unsplit one): central variables and outer state follow
    `update_rules.ps_push`, and the step counter the tickets."""
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
        ops, tau = push.push_update(
            variables, [u0, u1], pulled_version, strategy.counters, "dynsgd", None, opt, slots, 4
        )
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
            central[i], state[i] = update_rules.ps_push(
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


@pytest.mark.cluster
def test_outer_state_round_trips_through_a_checkpoint(sharded_cluster, tmp_path):
    """The outer momentum is saved beside the model, and a checkpoint restored
    before `fit` fills a fresh strategy's slots when `fit` creates them."""
    import keras

    import tf_asgd

    (x, y), _ = tf_asgd.data.load_digits()
    opt = update_rules.OuterSGD(0.7, momentum=0.9, nesterov=True)

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
