"""Outer optimizers: what the PS does with a push's pseudo-gradient.

A push's pseudo-gradient is `g = -scale(tau) * update` (the worker's displacement,
reversed, after staleness scaling: `staleness`). The PS applies an outer optimizer to it
(DiLoCo, Douillard et al. 2023): `OuterSGD` or `DelayedNesterov`, their defaults, limits
and gains, and one step of each (`outer_step`); also a moving average's push and what a
worker does with its own optimizer state. State is kept in Keras's velocity form
(`v = -lr * m`), so that TF's `ResourceApplyKerasMomentum` computes the same numbers on the
PS (`outer`). Pure: arrays and an array namespace `xp` (`numpy` or
`tensorflow.experimental.numpy`).
"""

import dataclasses
import typing

import numpy as np

WORKER_STATE_POLICIES = ("keep", "reset")


@dataclasses.dataclass(frozen=True)
class OuterSGD:
    """Outer SGD on the PS, optionally with (Nesterov) momentum.

    `OuterSGD()` (learning rate 1, no momentum) adds each push as it is: the
    classic parameter server. DiLoCo's outer optimizer is
    `OuterSGD(0.7, momentum=0.9, nesterov=True)`.

    Args:
        learning_rate: outer learning rate, > 0; the rate from the end of
            `schedule` on.
        momentum: outer momentum in [0, 1).
        nesterov: Nesterov momentum (needs `momentum > 0`).
        schedule: the outer rate of the first pushes (by version ticket), as
            linear ramps `((pushes, start_rate), ...)`: each ramp runs from its
            `start_rate` to the next ramp's (the last one's to
            `learning_rate`) over `pushes` pushes. Empty (a constant rate) by
            default; `((32, 0.125),)` warms up from 0.125 over 32 pushes.

    Raises:
        ValueError: `learning_rate` or a schedule's start rate not a number
            > 0, `momentum` not in [0, 1), `nesterov=True` without momentum,
            or a schedule that is not `(pushes, start_rate)` pairs with
            positive integer `pushes`.

    Examples:
        >>> opt = OuterSGD(0.25, schedule=((4, 0.25), (40, 0.5)))
        >>> [float(outer_learning_rate(opt, t)) for t in (0, 2, 4, 24, 44, 100)]
        [0.25, 0.375, 0.5, 0.375, 0.25, 0.25]
    """

    learning_rate: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    schedule: tuple = ()

    def __post_init__(self):
        _check_lr_momentum(self.learning_rate, self.momentum)
        if self.nesterov and not self.momentum:
            raise ValueError("OuterSGD(nesterov=True) needs momentum > 0.")
        try:
            ramps = tuple((pushes, rate) for pushes, rate in self.schedule)
        except (TypeError, ValueError):
            raise ValueError(
                "OuterSGD schedule must be a sequence of (pushes, start_rate) pairs, "
                f"got {self.schedule!r}."
            ) from None
        for pushes, rate in ramps:
            if isinstance(pushes, bool) or not isinstance(pushes, (int, np.integer)) or pushes < 1:
                raise ValueError(
                    f"OuterSGD schedule: pushes must be a positive integer, got {pushes!r}."
                )
            _check_lr_momentum(rate, 0.0, "schedule start_rate")
        # Hashable and comparable whatever sequence type was given.
        object.__setattr__(self, "schedule", tuple((int(p), float(r)) for p, r in ramps))

    @property
    def slots(self):
        """Names of the per-variable state kept on the PS.

        Returns:
            `("velocity",)` with momentum, else `()`.
        """
        return ("velocity",) if self.momentum else ()


@dataclasses.dataclass(frozen=True)
class DelayedNesterov:
    """Delayed Nesterov (Liu et al. 2024, arXiv:2401.09135), asynchronous DiLoCo.

    Pushes are buffered; every `delay` pushes (by version ticket) the
    momentum takes one step on their mean and is applied, Nesterov style.
    Between momentum steps each push is applied alone, scaled by
    `learning_rate / delay`. Over `delay` pushes this is one synchronous
    DiLoCo step on their mean.

    Args:
        learning_rate: outer learning rate, > 0.
        momentum: outer momentum in [0, 1).
        delay: pushes between momentum steps, a positive integer; `None` = the
            number of workers.

    Attributes:
        slots: the per-variable state kept on the PS, `("velocity", "buffer")`.

    Raises:
        ValueError: `learning_rate` not a number > 0, `momentum` not in
            [0, 1), or `delay` not `None` or a positive integer.

    Examples:
        >>> import numpy as np
        >>> opt = DelayedNesterov(1.0, momentum=0.5, delay=2)
        >>> theta, state = outer_step(opt, np.zeros(1), np.ones(1), {}, 0, 2)
        >>> theta, state["buffer"]  # the first push: applied alone at rate 1/2, buffered
        (array([-0.5]), array([1.]))
    """

    learning_rate: float = 0.7
    momentum: float = 0.9
    delay: typing.Optional[int] = None

    def __post_init__(self):
        _check_lr_momentum(self.learning_rate, self.momentum)
        if self.delay is not None and (
            isinstance(self.delay, bool)
            or not isinstance(self.delay, (int, np.integer))
            or self.delay < 1
        ):
            raise ValueError(
                f"DelayedNesterov delay must be a positive integer or None, got {self.delay!r}."
            )

    slots = ("velocity", "buffer")


def _check_lr_momentum(learning_rate, momentum, name="learning_rate"):
    if (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, (int, float))
        or not learning_rate > 0
    ):
        raise ValueError(f"Outer {name} must be a number > 0, got {learning_rate!r}.")
    if (
        isinstance(momentum, bool)
        or not isinstance(momentum, (int, float))
        or not 0 <= momentum < 1
    ):
        raise ValueError(f"Outer momentum must be in [0, 1), got {momentum!r}.")


def stability_limit(num_workers):
    """The largest constant per-push scale at which N workers stay stable: `2 sin(pi / (4N - 2))`.

    In round-robin order every push is `N - 1` pushes stale. Where a window's
    local steps have converged (a stiff direction, whose minimum `x*` the
    worker reaches within `n_sync` steps), a push is `x* - x_pull`, so the
    error follows `e[k+1] = e[k] - s * e[k - (N - 1)]`, which decays if and
    only if `0 < s < 2 sin(pi / (4N - 2))` (Levin and May 1976). N pushes of
    a round then add up to at most about `pi / 2` windows, whatever N is.
    See docs/defaults.md.

    Args:
        num_workers: N, the number of workers (at least 1).

    Returns:
        The limit, a Python float (2.0 for one worker).

    Examples:
        >>> round(stability_limit(8), 3)
        0.209
    """
    n = float(num_workers)
    return 2.0 * float(np.sin(np.pi / (4.0 * n - 2.0)))


def moving_average_sent(end, pulled, momentum, steps, xp=np):
    """What a window pushes of a moving average (BatchNormalization's moving mean and
    variance) after `steps` local steps at momentum `m`: `end - m^k pulled`, which is
    `(1 - m^k)` times the window's blend of its batches' statistics. The PS applies it with
    `moving_average_push`.

    Examples:
        >>> round(float(moving_average_sent(0.55, 1.0, 0.5, 1)), 3)  # a step toward 0.1
        0.05
    """
    return end - xp.asarray(momentum, dtype=xp.float64) ** steps * pulled


def moving_average_push(central, sent, momentum, steps, scale=1.0, xp=np):
    """A moving average's push applied where it stands now: `central + scale * (sent -
    (1 - m^k) central)`, that is the window's `k` steps of the average taken from the
    central value, as plain Keras takes them, whatever moved it since the pull.

    A push of `end - pulled` added as it is would overshoot where the average moved
    since the pull: a variance falling fast went below 0 under stale pushes, and held-out
    losses were NaN. Here each push is a convex combination of the central value and its
    window's statistics (for `scale` in [0, 1]), so a variance stays at or above 0, and N
    pushes move the average as far as N windows' steps in plain Keras.

    Args:
        central: the central value.
        sent: the push (`moving_average_sent`).
        momentum: the layer's momentum `m`, in [0, 1].
        steps: `k`, the window's local steps.
        scale: the push's staleness scale (0 for a push not made).

    Returns:
        The new central value.

    Examples:
        >>> round(float(moving_average_push(0.2, 0.05, 0.5, 1)), 3)  # 0.2 a step toward 0.1
        0.15
    """
    moved = 1.0 - xp.asarray(momentum, dtype=xp.float64) ** steps
    return central + scale * (sent - moved * central)


def default_outer_learning_rate(num_workers):
    """The default outer learning rate: `1/N`, each push's share of a round's average.

    Each push is one worker's displacement, carrying that worker's own
    momentum (or Adam moments) and computed from a copy `N - 1` pushes
    stale; `stability_limit(N)` bounds a constant per-push rate in the
    directions the windows converge in, and `1/N` stays below `2 / pi`
    (0.64) of it for every N. A rate at 2/3 of the limit gained at most 16%
    and oscillated under exact staleness; why: docs/defaults.md.

    Args:
        num_workers: N, the number of workers (at least 1).

    Returns:
        The rate, a Python float (1.0 for one worker).

    Examples:
        >>> [round(default_outer_learning_rate(n), 3) for n in (1, 2, 8, 16)]
        [1.0, 0.5, 0.125, 0.062]
    """
    return 1.0 / max(1, int(num_workers))


def default_outer_optimizer(num_workers, worker_peak=1.0):
    """The strategy's default outer optimizer for `num_workers` workers.

    `OuterSGD(default_outer_learning_rate(N))`: the average `1 / N` a push.
    On 3 and 4 workers, with a schedule for the first pushes: the first
    windows all start from the same weights, so the first round starts from
    the average; after it pushes decorrelate, and the rate rises over the
    first round to `min(2 / N, 1 / 2, stability_limit(N))` and falls back to
    the average over the next `10 N` pushes. Only where that rise times the
    workers' own peak factor stays within N, the large batch's linear rule:
    not under the anneal, whose workers start at N. Why: docs/defaults.md.

    Args:
        num_workers: N, the number of workers (at least 1).
        worker_peak: the factor on the workers' rate after the warm-up
            (`worker_rate.worker_rate_peak`): 1 at the user's rate.

    Returns:
        An `OuterSGD` without momentum.

    Examples:
        >>> opt = default_outer_optimizer(4)
        >>> [round(float(outer_learning_rate(opt, t)), 3) for t in (0, 4, 24, 44)]
        [0.25, 0.445, 0.348, 0.25]
        >>> default_outer_optimizer(4, worker_peak=4.0) == OuterSGD(0.25)
        True
    """
    n = num_workers
    average, peak = default_outer_learning_rate(n), min(2.0 / n, 0.5, stability_limit(n))
    if 3 <= n <= 4 and peak > average and worker_peak * peak / average <= n:
        return OuterSGD(average, schedule=((n, average), (10 * n, peak)))
    return OuterSGD(average)


SYNC_OUTER_MOMENTUM = 0.9  # DiLoCo's outer momentum (Douillard et al. 2023)


def default_synchronous_outer_optimizer(num_workers):
    """The synchronous mode's default outer optimizer: a round's step scaled by N.

    A synchronous round sees N windows' samples. On the mean of their
    displacements the PS takes one Nesterov step whose gain in a direction
    the windows agree on, `learning_rate / (1 - momentum)`, is N: the linear
    scaling rule (Goyal et al. 2017) applied to the round, as a batch N times
    larger takes about an N times larger step. The momentum carries the
    gain, so that the rate on a single round stays at most 1, inside the
    limit `2 (1 + m) / (1 + 2 m)` of a direction the windows converge in:
    momentum 0.9 (DiLoCo's) and rate `N / 10` up to 10 workers, then rate 1
    and momentum `1 - 1 / N`. One worker trains as plain Keras does. Why and
    what it measured: docs/defaults.md.

    Args:
        num_workers: N, the number of workers (at least 1).

    Returns:
        `OuterSGD(1.0)` for one worker, else a `DelayedNesterov` whose
        `delay` is N (one momentum step per round).

    Examples:
        >>> opt = default_synchronous_outer_optimizer(4)
        >>> round(opt.learning_rate, 3), opt.momentum, opt.delay
        (0.4, 0.9, 4)
        >>> round(outer_gain(default_synchronous_outer_optimizer(16), 16), 3)
        16.0
    """
    n = int(num_workers)
    if n <= 1:
        return OuterSGD(1.0)
    return nesterov_with_gain(n, n)


def nesterov_with_gain(gain, delay):
    """A `DelayedNesterov` whose gain `learning_rate / (1 - momentum)` is `gain`.

    Momentum 0.9 and rate `gain / 10` up to a gain of 10, then rate 1 and
    momentum `1 - 1 / gain` (`default_synchronous_outer_optimizer`).

    Args:
        gain: at least 1.
        delay: the `DelayedNesterov`'s delay (pushes a round).

    Examples:
        >>> nesterov_with_gain(4, 4)
        DelayedNesterov(learning_rate=0.4, momentum=0.9, delay=4)
    """
    lr = min(1.0, round(gain * (1.0 - SYNC_OUTER_MOMENTUM), 12))
    return DelayedNesterov(lr, max(SYNC_OUTER_MOMENTUM, 1.0 - lr / gain), delay=delay)


def outer_gain(opt, num_workers):
    """How many windows' worth a round of pushes moves the central weights, in steady state.

    In a direction that every push of a round agrees on (displacement `d` from
    each), momentum and rate together move the central weights by this many
    times `d` per round of `num_workers` pushes: `learning_rate / (1 - momentum)`
    for a `DelayedNesterov` (one step on the round's mean), and
    `num_workers * learning_rate / (1 - momentum)` for an `OuterSGD` (each push
    applied). This is the factor by which the strategy scales the effective
    learning rate; `AsyncStats.outer_gain` reports it.

    Args:
        opt: an `OuterSGD` or a `DelayedNesterov`.
        num_workers: pushes per round, N.

    Returns:
        A Python float (1.0 for plain averaging).

    Examples:
        >>> outer_gain(OuterSGD(0.25), 4)
        1.0
        >>> round(outer_gain(DelayedNesterov(0.7, 0.9), 8), 3)
        7.0
    """
    momentum_factor = 1.0 / (1.0 - opt.momentum)
    if isinstance(opt, DelayedNesterov):
        return opt.learning_rate * momentum_factor * num_workers / (opt.delay or num_workers)
    return num_workers * opt.learning_rate * momentum_factor


def outer_learning_rate(opt, ticket, xp=np):
    """`opt`'s learning rate for the push with version ticket `ticket` (its schedule).

    Args:
        opt: an `OuterSGD` or a `DelayedNesterov`.
        ticket: the push's version ticket (0 for the first push), a number or a tensor.
        xp: the array namespace: `numpy`, or `tensorflow.experimental.numpy` for
            the PS's push ops.

    Returns:
        The rate: a Python float, or a float64 tensor where `xp` is not `numpy`
        and `opt` has a schedule.

    Examples:
        >>> opt = OuterSGD(0.5, schedule=((4, 0.25),))
        >>> [float(outer_learning_rate(opt, t)) for t in (0, 2, 4, 100)]
        [0.25, 0.375, 0.5, 0.5]
    """
    knots = _schedule_knots(opt)
    if not knots:
        return opt.learning_rate
    if xp is np:  # a Python float, so that float32 arrays stay float32
        t = float(ticket)
        for (ta, ra), (tb, rb) in zip(knots, knots[1:]):
            if t < tb:
                return ra + (rb - ra) * ((t - ta) / (tb - ta))
        return opt.learning_rate
    # Traced on the chief into the PS's push ops: a `where` per ramp, no branches.
    t = xp.asarray(ticket, dtype=xp.float64)
    rate = xp.asarray(opt.learning_rate, dtype=xp.float64)
    for (ta, ra), (tb, rb) in reversed(list(zip(knots, knots[1:]))):
        rate = xp.where(t < tb, ra + (rb - ra) * ((t - ta) / (tb - ta)), rate)
    return rate


def _schedule_knots(opt):
    """`[(ticket, rate), ...]` where `opt`'s ramps start and end; `[]` without one."""
    ramps = getattr(opt, "schedule", ())
    if not ramps:
        return []
    knots, t = [], 0
    for pushes, rate in ramps:
        knots.append((float(t), rate))
        t += pushes
    return knots + [(float(t), opt.learning_rate)]


def validate_outer_optimizer(opt):
    """Returns `opt` if it is an outer optimizer; raises `TypeError` naming it otherwise."""
    if not isinstance(opt, (OuterSGD, DelayedNesterov)):
        raise TypeError(
            "outer_optimizer must be tf_asgd.OuterSGD(...) or tf_asgd.DelayedNesterov(...), "
            f"got {opt!r}."
        )
    return opt


def validate_worker_state(policy):
    """Checks a worker-state policy; raises `ValueError` naming the problem."""
    if policy not in WORKER_STATE_POLICIES:
        raise ValueError(
            f"Unknown worker_state {policy!r}; expected one of "
            f"{', '.join(repr(p) for p in WORKER_STATE_POLICIES)}."
        )


def outer_sgd(theta, g, velocity, learning_rate, momentum, nesterov, xp=np):
    """One outer SGD step on pseudo-gradient `g`: returns `(theta, velocity)`.

    `velocity` is ignored (and returned as is) without momentum.
    """
    if not momentum:
        return theta - learning_rate * g, velocity
    velocity = momentum * velocity - learning_rate * g
    if nesterov:
        return theta + momentum * velocity - learning_rate * g, velocity
    return theta + velocity, velocity


def delayed_nesterov(theta, g, velocity, buffer, ticket, learning_rate, momentum, delay, xp=np):
    """One push under delayed Nesterov: returns `(theta, velocity, buffer)`.

    `ticket` is the push's 0-based version ticket; the pushes whose ticket is
    `delay - 1 (mod delay)` take the momentum step on the buffer's mean.
    """
    buffer = buffer + g
    if (ticket + 1) % delay:
        return theta - (learning_rate / delay) * g, velocity, buffer
    velocity = momentum * velocity - (learning_rate / delay) * buffer
    theta = theta + momentum * velocity - (learning_rate / delay) * g
    return theta, velocity, xp.zeros_like(buffer)


def outer_step(opt, theta, g, state, ticket, num_workers, xp=np):
    """`opt` applied to one push's pseudo-gradient `g`; returns `(theta, state)`.

    `state` is a dict of `opt.slots` arrays (missing ones start at zero).
    """
    state = {name: state.get(name, xp.zeros_like(theta)) for name in opt.slots}
    if isinstance(opt, OuterSGD):
        lr = outer_learning_rate(opt, ticket, xp=xp)
        theta, v = outer_sgd(theta, g, state.get("velocity"), lr, opt.momentum, opt.nesterov, xp=xp)
        if opt.momentum:
            state["velocity"] = v
        return theta, state
    if not isinstance(opt, DelayedNesterov):
        validate_outer_optimizer(opt)
    delay = opt.delay or num_workers
    theta, state["velocity"], state["buffer"] = delayed_nesterov(
        theta,
        g,
        state["velocity"],
        state["buffer"],
        ticket,
        opt.learning_rate,
        opt.momentum,
        delay,
        xp=xp,
    )
    return theta, state
