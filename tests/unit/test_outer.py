"""Outer optimizers: the PS's TF ops against the pure NumPy rule, push by push; the
pure rule's defaults, limits, examples and moving averages."""

import numpy as np
import pytest
import tensorflow as tf

from tf_asgd.rules import outer, outer_optimizers, staleness, worker_rate

OPTIMIZERS = [
    outer_optimizers.OuterSGD(),
    outer_optimizers.OuterSGD(0.5),
    outer_optimizers.OuterSGD(0.7, momentum=0.9),
    outer_optimizers.OuterSGD(0.7, momentum=0.9, nesterov=True),
    outer_optimizers.OuterSGD(0.5, schedule=((6, 0.25),)),
    outer_optimizers.OuterSGD(0.5, momentum=0.5, schedule=((4, 0.1),)),
    outer_optimizers.OuterSGD(0.25, schedule=((2, 0.25), (5, 0.5))),
    outer_optimizers.default_outer_optimizer(4),
    outer_optimizers.DelayedNesterov(0.7, 0.9),
    outer_optimizers.DelayedNesterov(1.0, 0.5, delay=3),
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
        scale = staleness.staleness_scale(tau, rule)
        push(tf.constant(update), tf.constant(scale), tf.constant(ticket, tf.int64))
        central, state = staleness.ps_push(
            central, update, tau, ticket, state, rule, outer=opt, num_workers=workers
        )
        np.testing.assert_allclose(var.numpy(), central, rtol=1e-5, atol=1e-6)
        for name, slot in slots.items():
            np.testing.assert_allclose(slot.numpy(), state[name], rtol=1e-5, atol=1e-6)


def test_an_asynchronous_delayed_nesterov_close_writes_the_velocity_under_its_lock():
    """Pushes reach a PS concurrently. A group's close that read the velocity, then
    added what it computed from that read, would lose one of two closes that overlap;
    the velocity is written only by one locked read-modify-write op."""
    opt = outer_optimizers.DelayedNesterov(0.7, 0.9, delay=2)
    var = tf.Variable(tf.zeros([3]))
    slots = outer.create_slots(opt, var)

    @tf.function
    def push(piece, ticket):
        outer.apply(opt, var, piece, slots, tf.constant(1.0), ticket, 4)

    graph = push.get_concrete_function(
        tf.TensorSpec([3], tf.float32), tf.TensorSpec([], tf.int64)
    ).graph
    velocity = [t for t in graph.captures if t[0] is slots["velocity"].handle][0][1]

    def writes(op):
        return op.type.startswith(("Assign", "ResourceApply")) and any(
            t is velocity for t in op.inputs
        )

    writers = [op for op in graph.get_operations() if writes(op)]
    assert [op.type for op in writers] == ["ResourceApplyMomentum"]
    assert writers[0].get_attr("use_locking")


def test_defaults_are_the_classic_parameter_server():
    central, update = np.array([1.0, 2.0]), np.array([4.0, -4.0])
    out, state = staleness.ps_push(central, update, 3, 7, {}, "dynsgd")
    np.testing.assert_allclose(out, [2.0, 1.0])
    assert state == {} and outer_optimizers.OuterSGD().slots == ()


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
    limit = outer_optimizers.stability_limit(workers)
    assert _decays(0.95 * limit, workers - 1)
    assert not _decays(1.05 * limit, workers - 1)


def test_default_outer_learning_rate():
    # One worker: plain Keras; else the average, inside the stability limit.
    got = [outer_optimizers.default_outer_learning_rate(n) for n in (1, 2, 3, 4, 5, 8, 16, 32)]
    np.testing.assert_allclose(got, [1.0, 0.5, 1 / 3, 0.25, 0.2, 0.125, 0.0625, 1 / 32])
    limit = outer_optimizers.stability_limit
    for n in range(2, 101):
        assert outer_optimizers.default_outer_learning_rate(n) < 2 / np.pi * limit(n)


def test_default_outer_optimizer_rises_over_the_first_round_then_falls():
    # 4 workers: 1/4 rising to the stability limit over the first 4 pushes,
    # then back to 1/4 over 40.
    limit4 = outer_optimizers.stability_limit(4)
    opt = outer_optimizers.default_outer_optimizer(4)
    got = [outer_optimizers.outer_learning_rate(opt, t) for t in (0, 2, 4, 24, 44, 1000)]
    expected = [0.25, (0.25 + limit4) / 2, limit4, (limit4 + 0.25) / 2, 0.25, 0.25]
    np.testing.assert_allclose(got, expected)
    # 3 workers: the peak is capped at 1/2 (two workers' sum diverged).
    opt = outer_optimizers.default_outer_optimizer(3)
    got = [outer_optimizers.outer_learning_rate(opt, t) for t in (0, 3, 33)]
    np.testing.assert_allclose(got, [1 / 3, 0.5, 1 / 3])
    # From 5 workers on: the average from the start, no schedule.
    for n in (5, 8, 16, 100):
        assert outer_optimizers.default_outer_optimizer(n) == outer_optimizers.OuterSGD(1.0 / n)
    # Up to 2 workers the default is the average from the start.
    assert outer_optimizers.default_outer_optimizer(1) == outer_optimizers.OuterSGD(1.0)
    assert outer_optimizers.default_outer_optimizer(2) == outer_optimizers.OuterSGD(0.5)
    # The ramp is applied to the pseudo-gradient push by push.
    theta, _ = outer_optimizers.outer_step(
        outer_optimizers.default_outer_optimizer(4),
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
                outer_optimizers.default_outer_optimizer(4), 4, tf.constant(t, tf.int64)
            )
        )
        for t in (0, 2, 4, 24, 44, 1000)
    ]
    np.testing.assert_allclose(rates, expected)


def test_the_first_round_rise_keeps_the_workers_rate_within_the_linear_rule():
    """The rise on 3 and 4 workers times the workers' peak factor stays within N: it
    stays at the user's rate (1) and `sqrt(N)` (SGD's default), and is dropped under the
    anneal, whose workers start at N, and for a factor that leaves no room for it."""
    for n in (3, 4):
        boosted = outer_optimizers.default_outer_optimizer(n)
        rise = outer_optimizers.outer_learning_rate(boosted, n) * n  # at its peak, over 1/N
        for rule in ("none", "sqrt", "anneal", "linear", 1.5):
            peak = worker_rate.worker_rate_peak(n, rule)
            opt = outer_optimizers.default_outer_optimizer(n, worker_peak=peak)
            assert (opt == boosted) == (peak * rise <= n), (n, rule)
            assert (opt == boosted) == (rule in ("none", "sqrt", 1.5)), (n, rule)
        at_the_linear_rule = outer_optimizers.default_outer_optimizer(n, worker_peak=n)
        assert at_the_linear_rule == outer_optimizers.OuterSGD(1.0 / n)


def test_schedule_is_normalised_so_equal_optimizers_compare_equal():
    assert outer_optimizers.OuterSGD(0.5, schedule=[[4, 1]]) == outer_optimizers.OuterSGD(
        0.5, schedule=((4, 1.0),)
    )


def test_delayed_nesterov_is_diloco_over_each_group():
    # Over `delay` pushes: theta -= lr * (mean(g) + mu * v), v = mu * v + mean(g) (Nesterov).
    opt = outer_optimizers.DelayedNesterov(0.7, 0.9, delay=2)
    theta, state = np.zeros(1), {}
    gs = [1.0, 3.0, -1.0, 5.0]
    m, ref = 0.0, 0.0
    for ticket, g in enumerate(gs):
        theta, state = outer_optimizers.outer_step(opt, theta, np.array([g]), state, ticket, 2)
        if ticket % 2:
            mean = (gs[ticket - 1] + g) / 2
            m = 0.9 * m + mean
            ref -= 0.7 * (mean + 0.9 * m)
            np.testing.assert_allclose(theta, [ref])


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: outer_optimizers.OuterSGD(0.0), ValueError, "learning_rate must be a number > 0"),
        (
            lambda: outer_optimizers.OuterSGD(1.0, momentum=1.0),
            ValueError,
            r"momentum must be in \[0, 1\)",
        ),
        (lambda: outer_optimizers.OuterSGD(1.0, nesterov=True), ValueError, "needs momentum > 0"),
        (
            lambda: outer_optimizers.DelayedNesterov(delay=0),
            ValueError,
            "delay must be a positive integer",
        ),
        (
            lambda: outer_optimizers.OuterSGD(1.0, schedule=((0, 0.5),)),
            ValueError,
            "pushes must be a positive integer",
        ),
        (
            lambda: outer_optimizers.OuterSGD(1.0, schedule=((8, 0.0),)),
            ValueError,
            "schedule start_rate must be a number > 0",
        ),
        (
            lambda: outer_optimizers.OuterSGD(1.0, schedule=(8, 0.5)),
            ValueError,
            r"sequence of \(pushes, start_rate\) pairs",
        ),
        (
            lambda: outer_optimizers.validate_outer_optimizer("adam"),
            TypeError,
            "outer_optimizer must be",
        ),
        (
            lambda: outer_optimizers.validate_worker_state("zero"),
            ValueError,
            "Unknown worker_state 'zero'",
        ),
    ],
)
def test_bad_outer_configuration(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_the_pure_rules_examples_run():
    """The docstrings' examples (the default rates, the gains) are what the code computes."""
    import doctest

    tried = 0
    for module in (staleness, outer_optimizers, worker_rate):
        failures, count = doctest.testmod(module)
        assert failures == 0 and count > 0, module.__name__
        tried += count
    assert tried >= 20


@pytest.mark.parametrize("scale,momentum,steps", [(1.0, 0.99, 10), (1.0, 0.5, 3), (0.0, 0.9, 10)])
def test_the_moving_average_op_is_the_pure_rule(scale, momentum, steps):
    """`outer.apply_moving_average`'s one locked op (a proximal step) computes
    `outer_optimizers.moving_average_push`."""
    central = np.array([0.02, 1.0, 3.5], np.float32)
    sent = np.array([0.004, -0.2, 0.5], np.float32)
    shard = tf.Variable(central)
    outer.apply_moving_average(shard, tf.constant(sent), tf.constant(scale), momentum, steps)
    want = outer_optimizers.moving_average_push(
        central.astype(np.float64), sent.astype(np.float64), momentum, steps, scale
    )
    np.testing.assert_allclose(shard.numpy(), want, rtol=1e-6, atol=1e-7)


def _plain_moving_average(value, stats, momentum, steps):
    """Keras's update of a moving average, `steps` times toward `stats`."""
    for _ in range(steps):
        value = momentum * value + (1 - momentum) * stats
    return value


@pytest.mark.parametrize("momentum,steps", [(0.99, 10), (0.9, 10), (0.5, 3)])
def test_a_moving_average_push_takes_the_windows_steps_from_where_it_stands(momentum, steps):
    """A window pulled 1.0 and took `k` steps toward 0.01; by its push, other pushes had
    moved the variance to 0.02. Applied where it stands, the push equals plain Keras's `k`
    steps from 0.02 and stays above 0; added as it was (`end - pulled`) it went below 0
    at low momentum. N such pushes in turn equal plain Keras's N k steps."""
    pulled, stats, now = 1.0, 0.01, 0.02
    end = _plain_moving_average(pulled, stats, momentum, steps)
    sent = outer_optimizers.moving_average_sent(end, pulled, momentum, steps)
    pushed = outer_optimizers.moving_average_push(now, sent, momentum, steps)
    np.testing.assert_allclose(pushed, _plain_moving_average(now, stats, momentum, steps))
    assert pushed > 0
    if momentum <= 0.9:
        assert now + (end - pulled) < 0  # the delta added as it was
    value = 1.0
    for _ in range(4):
        value = outer_optimizers.moving_average_push(value, sent, momentum, steps)
    np.testing.assert_allclose(value, _plain_moving_average(1.0, stats, momentum, 4 * steps))
    # A push not made (scale 0) leaves it.
    assert outer_optimizers.moving_average_push(now, sent, momentum, steps, scale=0.0) == now
