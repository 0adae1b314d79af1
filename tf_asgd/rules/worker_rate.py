"""The workers' learning-rate factor: how N workers scale their optimizer's rate.

The rules of the strategy's `lr_scaling` (`WORKER_RATE_RULES`): the factor at the end of
the warm-up (`worker_rate_peak`), the one it falls toward (`worker_rate_scale`), the
warm-up's length, and the factor at each step of a `fit` (`annealed_rate_scale`), with
`numpy` or, inside a window, `tensorflow.experimental.numpy` (`xp`). Why: docs/defaults.md.
"""

import numpy as np

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


def auto_worker_rate(synchronous=False, outer_given=False, adaptive=False, scheduled=False):
    """The rule `lr_scaling="auto"` stands for: where the PS averages the pushes (the
    asynchronous default outer optimizer), for an adaptive optimizer (Adam and its kin:
    `optimizer_options.is_adaptive`) `"anneal"`, or `"linear"` where its rate is a
    `LearningRateSchedule` (`scheduled`: the user's schedule already lowers the rate late
    in the fit, which is what the anneal is for, so N stays on it as on the large batch's),
    and `"sqrt"` for others; else `"none"` (an outer optimizer given, or synchronous
    rounds, sets the round's gain on the PS). Why: docs/defaults.md.

    Examples:
        >>> auto_worker_rate(), auto_worker_rate(adaptive=True)
        ('sqrt', 'anneal')
        >>> auto_worker_rate(adaptive=True, scheduled=True), auto_worker_rate(scheduled=True)
        ('linear', 'sqrt')
        >>> auto_worker_rate(synchronous=True, adaptive=True)
        'none'
    """
    if synchronous or outer_given:
        return "none"
    if adaptive:
        return "linear" if scheduled else "anneal"
    return "sqrt"


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
