"""Pure update rules: staleness scaling on the PS and GEM's energy matching.

Every rule is a small function of arrays and an array namespace `xp` (`numpy` or
`tensorflow.experimental.numpy`), so one definition serves the cluster path (TF ops on the
PS or the worker), the many-worker simulator (NumPy) and the tests' references.

Example:
    >>> import numpy as np
    >>> from tf_asgd.rules import update_rules
    >>> float(update_rules.staleness_scale(3, "dynsgd"))
    0.25
    >>> update_rules.apply_push(np.zeros(2), np.ones(2), tau=1, rule="dynsgd")
    array([0.5, 0.5])
"""

import dataclasses
import typing

import numpy as np

STALENESS_RULES = ("none", "dynsgd")

# Defaults of the GEM reference code (Hermans & Louppe 2018).
GEM_PI_MAX = 5.0
GEM_EPSILON = 1e-12


def validate_staleness(rule, max_staleness=None):
    """Checks a staleness configuration; raises `ValueError` naming the problem."""
    if rule not in STALENESS_RULES:
        raise ValueError(
            f"Unknown staleness rule {rule!r}; expected one of "
            f"{', '.join(repr(r) for r in STALENESS_RULES)}."
        )
    if max_staleness is not None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, (int, np.integer)):
            raise ValueError(
                f"max_staleness must be a non-negative integer or None, got {max_staleness!r}."
            )
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}.")


def staleness_scale(tau, rule="dynsgd", max_staleness=None, xp=np):
    """The factor the PS multiplies a push by, given its staleness `tau`.

    - `"none"` (Downpour): 1.
    - `"dynsgd"` (DynSGD): 1 / (tau + 1).
    A push with `tau > max_staleness` is dropped: its factor is 0.
    """
    tau = xp.asarray(tau, dtype=xp.float32)
    if rule == "none":
        scale = xp.ones_like(tau)
    elif rule == "dynsgd":
        scale = 1.0 / (tau + 1.0)
    else:
        validate_staleness(rule)
    if max_staleness is not None:
        scale = xp.where(tau > max_staleness, xp.zeros_like(scale), scale)
    return scale


def is_dropped(tau, max_staleness=None):
    """Whether a push of staleness `tau` is dropped by `max_staleness`."""
    return max_staleness is not None and tau > max_staleness


def apply_push(central, update, tau, rule="dynsgd", max_staleness=None, xp=np):
    """The classic PS rule: `central + scale(tau) * update` (`ps_push` with
    the default `OuterSGD()`)."""
    return ps_push(central, update, tau, 0, {}, rule, max_staleness, xp=xp)[0]


def ps_push(
    central,
    update,
    tau,
    ticket,
    state,
    rule="dynsgd",
    max_staleness=None,
    outer=None,
    num_workers=1,
    xp=np,
):
    """The PS rule: the outer optimizer on pseudo-gradient `-scale(tau) * update`.

    Args:
        central: the central variable.
        update: the worker's accumulated update (`local_end - local_start`).
        tau: the push's staleness.
        ticket: the push's 0-based version ticket.
        state: the outer optimizer's state for this variable (a dict).
        rule, max_staleness: the staleness rule (`staleness_scale`).
        outer: `OuterSGD` or `DelayedNesterov`; default `OuterSGD()`.
        num_workers: the number of workers (`DelayedNesterov`'s default delay).

    Returns:
        `(new_central, new_state)`.
    """
    scale = xp.asarray(staleness_scale(tau, rule, max_staleness, xp=xp), dtype=update.dtype)
    return outer_step(
        outer or OuterSGD(), central, -scale * update, state, ticket, num_workers, xp=xp
    )


def gem_pi(g, m, dc, kappa, pi_max=GEM_PI_MAX, eps=GEM_EPSILON, xp=np):
    """GEM's element-wise rescaling factor.

    `pi = clip((kappa * |m| - |dc|) / (|g| + eps), 0, pi_max)`, where `g` is
    the worker's update, `m` the proxy momentum (already updated with `g`)
    and `dc` how far the central variable moved since this worker's previous
    pull.
    """
    pi = (kappa * xp.abs(m) - xp.abs(dc)) / (xp.abs(g) + eps)
    return xp.clip(pi, 0.0, pi_max)


def gem_step(g, m, dc, mu, kappa, pi_max=GEM_PI_MAX, eps=GEM_EPSILON, xp=np):
    """One GEM push on a worker.

    Args:
        g: the worker's update, `-eta * grad` (or a window's accumulated one).
        m: the worker's proxy momentum before this push.
        dc: `central_now - central_at_previous_pull`.
        mu: the proxy's momentum.
        kappa: GEM's amplification factor.

    Returns:
        `(pushed, new_m, pi)`: the update to push (`pi * g`), the new proxy
        momentum `mu * m + g`, and `pi`.
    """
    new_m = mu * m + g
    pi = gem_pi(g, new_m, dc, kappa, pi_max, eps, xp=xp)
    return pi * g, new_m, pi


# ---- outer optimizers: what the PS does with a push -------------------------
#
# A push's pseudo-gradient is `g = -scale(tau) * update` (the worker's
# displacement, reversed, after staleness scaling). The PS applies an outer
# optimizer to it (DiLoCo, Douillard et al. 2023). State is kept in Keras's
# velocity form (`v = -lr * m`), so that TF's `ResourceApplyKerasMomentum`
# computes the same numbers on the PS.

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
            (`worker_rate_peak`): 1 at the user's rate.

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


WORKER_RATE_RULES = ("auto", "none", "linear", "sqrt", "anneal")
WORKER_RATE_WARMUP = 0.05  # of each fit's steps: Goyal et al.'s 5 of 90 epochs
ANNEAL_WARMUP = 0.25  # of each fit's steps, for the anneal's peak of N: docs/defaults.md


def worker_rate_warmup(peak, final):
    """The share of each `fit`'s steps over which the workers' factor rises from 1 to
    `peak`: a quarter where it peaks above where it ends (the anneal from N), else Goyal et
    al.'s 5%. Why: early on the gradient's signal dominates its noise and Adam's steps are
    at their largest, so N times the rate there makes each step larger, not less noisy.

    Examples:
        >>> worker_rate_warmup(8.0, 1.0), worker_rate_warmup(2.0, 2.0)
        (0.25, 0.05)
    """
    return ANNEAL_WARMUP if peak > final else WORKER_RATE_WARMUP


def untuned_warmup_steps(beta_2):
    """`2 / (1 - beta_2)`: the warm-up Ma & Yarats (2021, arXiv:1910.04209) found
    adequate for Adam without tuning, the steps over which its second-moment estimate
    settles (2,000 at Keras's default 0.999); None without a `beta_2`.

    Examples:
        >>> untuned_warmup_steps(0.999), untuned_warmup_steps(None)
        (2000, None)
    """
    if beta_2 is None or not 0.0 <= float(beta_2) < 1.0:
        return None
    return max(1, round(2.0 / (1.0 - float(beta_2))))


def worker_rate_warmup_steps(peak, final, fit_steps, cap=None):
    """The steps at the start of a `fit` over which the workers' factor rises to `peak`:
    `worker_rate_warmup`'s share of the fit's `fit_steps`, at most `cap`
    (`untuned_warmup_steps` of Adam's kin). With the cap, a `fit` planned longer warms up
    no longer, so it reaches an accuracy no later.

    Examples:
        >>> [worker_rate_warmup_steps(8.0, 1.0, t, cap=2000) for t in (400, 8000, 16000)]
        [100, 2000, 2000]
    """
    steps = max(1, round(worker_rate_warmup(peak, final) * max(0, int(fit_steps or 0))))
    return steps if cap is None else max(1, min(steps, int(cap)))


def validate_worker_rate(scaling):
    """Checks the strategy's `lr_scaling`: one of `WORKER_RATE_RULES` or a number > 0."""
    if isinstance(scaling, str) and scaling in WORKER_RATE_RULES:
        return
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and scaling > 0:
        if np.isfinite(scaling):
            return
    raise ValueError(
        f"lr_scaling must be one of {', '.join(repr(r) for r in WORKER_RATE_RULES)} or a "
        f"finite number > 0, got {scaling!r}."
    )


def auto_worker_rate(synchronous=False, outer_given=False, adaptive=False):
    """The rule `lr_scaling="auto"` stands for: where the PS averages the pushes (the
    asynchronous default outer optimizer), `"anneal"` for an adaptive optimizer (Adam
    and its kin: `optimizer_options.is_adaptive`) and `"sqrt"` for others; else
    `"none"` (an outer optimizer given, or synchronous rounds, sets the round's gain on
    the PS). Why: docs/defaults.md.

    Examples:
        >>> auto_worker_rate(), auto_worker_rate(adaptive=True)
        ('sqrt', 'anneal')
        >>> auto_worker_rate(synchronous=True, adaptive=True)
        'none'
    """
    if synchronous or outer_given:
        return "none"
    return "anneal" if adaptive else "sqrt"


def worker_rate_scale(num_workers, rule):
    """The factor on each worker's learning rate: what N workers' windows need for a
    round of them, averaged, to move as far as one step of the batch N times larger.

    `"linear"`: N, the linear scaling rule for SGD (Goyal et al. 2017,
    arXiv:1706.02677). `"sqrt"`: `sqrt(N)`, the square-root rule for adaptive
    optimizers such as Adam (Malladi et al. 2022, arXiv:2205.10287). `"anneal"`:
    1 once annealed, from N (`worker_rate_peak`): the user's rate, where the mean of N
    windows has a window's noise variance over N. `"none"`: 1. A number is the factor
    itself. Why the workers and not the PS: docs/defaults.md.

    Args:
        num_workers: N, the number of workers (at least 1).
        rule: `"linear"`, `"sqrt"`, `"anneal"`, `"none"` or a number > 0.

    Returns:
        A Python float (1.0 for one worker under a named rule).

    Examples:
        >>> worker_rate_scale(8, "linear"), worker_rate_scale(4, "sqrt")
        (8.0, 2.0)
        >>> worker_rate_scale(8, "anneal")
        1.0
    """
    if not isinstance(rule, str):
        return float(rule)
    n = max(1, int(num_workers))
    root = float(np.sqrt(n))
    return {"none": 1.0, "linear": float(n), "sqrt": root, "anneal": 1.0}[rule]


def worker_rate_peak(num_workers, rule):
    """The factor on each worker's rate at the end of the warm-up: N for `"anneal"`
    (the large batch's linear rule), from which it falls to `worker_rate_scale`;
    `worker_rate_scale` itself for the other rules.

    Examples:
        >>> worker_rate_peak(8, "anneal"), worker_rate_peak(4, "sqrt")
        (8.0, 2.0)
    """
    if rule == "anneal":
        return float(max(1, int(num_workers)))
    return worker_rate_scale(num_workers, rule)


def warmed_up_rate_scale(scale, step, warmup_steps, xp=np):
    """`scale` reached linearly over the first `warmup_steps` steps (Goyal et al.'s
    gradual warm-up): `1 + (scale - 1) * min(1, (step + 1) / warmup_steps)`.

    Args:
        scale: the full factor (`worker_rate_scale`).
        step: the optimizer's step count (every worker's steps), a number or a tensor.
        warmup_steps: steps to reach `scale`, at least 1.
        xp: `numpy`, or `tensorflow.experimental.numpy` inside a window.

    Examples:
        >>> [float(warmed_up_rate_scale(3.0, t, 4)) for t in (0, 1, 3, 100)]
        [1.5, 2.0, 3.0, 3.0]
    """
    return annealed_rate_scale(scale, scale, step, warmup_steps, xp)


def annealed_rate_scale(peak, final, step, warmup_steps, xp=np):
    """The workers' factor at `step` of a `fit`: from 1 up to `peak` linearly over the
    first `warmup_steps` steps (Goyal et al.'s warm-up), then falling toward `final` as
    `1 / t`: `final + (peak - final) * warmup_steps / (step + 1)`.

    The fall depends on the steps taken, not on how long the `fit` is planned: a longer
    `fit` runs the same factor up to any step, so it reaches an accuracy no later. It
    halves the excess over `final` every time the steps double (Robbins & Monro's 1/t).

    Args:
        peak: the factor after the warm-up (`worker_rate_peak`).
        final: the factor it falls toward (`worker_rate_scale`); `peak` for none.
        step: the optimizer's step count (every worker's steps) since the `fit`'s
            first step, a number or a tensor.
        warmup_steps: steps to reach `peak`, at least 1 (a number or a tensor).
        xp: `numpy`, or `tensorflow.experimental.numpy` inside a window.

    Examples:
        >>> [round(float(annealed_rate_scale(8.0, 1.0, t, 4)), 3) for t in (0, 3, 7, 15, 399)]
        [2.75, 8.0, 4.5, 2.75, 1.07]
    """
    t = xp.asarray(step, dtype=xp.float32) + 1.0
    warmup = xp.maximum(1.0, xp.asarray(warmup_steps, dtype=xp.float32))
    ramp = xp.minimum(1.0, t / warmup)
    top = float(final) + (float(peak) - float(final)) * xp.minimum(1.0, warmup / t)
    return 1.0 + (top - 1.0) * ramp


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
