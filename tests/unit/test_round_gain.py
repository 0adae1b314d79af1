"""The synchronous default rule gets a large batch's progress from N windows; averaging
at the user's rate does not, and the asynchronous default's workers' rate (`lr_scaling`)
gets much of it back.

A noisy quadratic (linear regression with label noise, curvatures from 1 to 0.03)
where a batch of N x B at N times the rate (the linear scaling rule) is the
reference. Windows of plain SGD go through the PS's own rule, `outer_optimizers.outer_step`.
"""

import numpy as np
import pytest

from tf_asgd.rules import outer_optimizers, worker_rate

DIM, WORKERS, BATCH, N_SYNC, RATE, STEPS = 20, 8, 4, 10, 0.01, 3000
CURVATURES = np.logspace(0, -1.5, DIM)


class NoisyQuadratic:
    """Samples `x ~ N(0, diag(CURVATURES))`, `y = x . w* + N(0, 1)`; loss is the excess risk."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.w_star = self.rng.normal(size=DIM)

    def gradient(self, w, batch):
        x = self.rng.normal(size=(batch, DIM)) * np.sqrt(CURVATURES)
        y = x @ self.w_star + self.rng.normal(size=batch)
        return x.T @ (x @ w - y) / batch

    def loss(self, w):
        return 0.5 * float(np.sum(CURVATURES * (w - self.w_star) ** 2))


def sgd_curve(batch, rate, seed=0):
    """Loss after each step of plain SGD."""
    problem, w, losses = NoisyQuadratic(seed), np.zeros(DIM), []
    for _ in range(STEPS):
        w = w - rate * problem.gradient(w, batch)
        losses.append(problem.loss(w))
    return np.array(losses)


def window_curve(opt, synchronous, seed=0, lr_scaling="none"):
    """Loss of the central weights per step of each worker (a round is `N_SYNC` steps);
    the workers' rate is `RATE` times `lr_scaling`'s factor, warmed up (and annealed)
    as the strategy does (`worker_rate.worker_rate_warmup_steps`)."""
    problem, center, state, losses = NoisyQuadratic(seed), np.zeros(DIM), {}, []
    starts = [center] * WORKERS
    peak = worker_rate.worker_rate_peak(WORKERS, lr_scaling)
    final = worker_rate.worker_rate_scale(WORKERS, lr_scaling)
    warmup = worker_rate.worker_rate_warmup_steps(peak, final, STEPS * WORKERS)
    for ticket in range(STEPS * WORKERS // N_SYNC):
        i = ticket % WORKERS
        w = starts[i]
        for k in range(N_SYNC):
            step = ticket * N_SYNC + k
            factor = worker_rate.annealed_rate_scale(peak, final, step, warmup)
            rate = RATE * factor
            w = w - rate * problem.gradient(w, BATCH)
        center, state = outer_optimizers.outer_step(
            opt, center, starts[i] - w, state, ticket, WORKERS
        )
        if not synchronous:
            starts[i] = center  # round-robin: every push is WORKERS - 1 pushes stale
        elif i == WORKERS - 1:
            starts = [center] * WORKERS
        if i == WORKERS - 1:
            losses += [problem.loss(center)] * N_SYNC
    return np.array(losses)


def steps_to(curve, target):
    reached = np.nonzero(curve <= target)[0]
    return int(reached[0]) + 1 if len(reached) else np.inf


@pytest.fixture(scope="module")
def reference():
    one = sgd_curve(BATCH, RATE)
    target = 1.5 * float(np.mean(one[-500:]))  # 1.5x the one-worker noise floor
    large = steps_to(sgd_curve(WORKERS * BATCH, WORKERS * RATE), target)
    assert steps_to(one, target) > 5 * large  # the large batch pays here
    return target, large


def test_the_synchronous_default_comes_close_to_the_large_batch(reference):
    target, large = reference
    opt = outer_optimizers.default_synchronous_outer_optimizer(WORKERS)
    assert outer_optimizers.outer_gain(opt, WORKERS) == pytest.approx(WORKERS)
    assert steps_to(window_curve(opt, synchronous=True), target) <= 2 * large


def test_averaging_falls_far_short_of_the_large_batch(reference):
    target, large = reference
    asynchronous = outer_optimizers.default_outer_optimizer(WORKERS)
    assert steps_to(window_curve(asynchronous, synchronous=False), target) >= 5 * large
    average = outer_optimizers.OuterSGD(1.0 / WORKERS)
    assert steps_to(window_curve(average, synchronous=True), target) >= 5 * large


def test_the_workers_rate_gets_averaging_much_of_the_large_batch_back(reference):
    """sqrt(N) (the default, `lr_scaling="auto"`) reaches the target over twice as
    soon as averaging at the user's rate (here 771 steps against 1,981; the large
    batch 262); N (`"linear"`, the large batch's own rule for SGD) within 1.5 times
    the large batch's steps, its warm-up included (331)."""
    target, large = reference
    asynchronous = outer_optimizers.default_outer_optimizer(WORKERS)
    assert worker_rate.auto_worker_rate() == "sqrt"
    user = steps_to(window_curve(asynchronous, synchronous=False), target)
    sqrt = steps_to(window_curve(asynchronous, False, lr_scaling="sqrt"), target)
    linear = steps_to(window_curve(asynchronous, False, lr_scaling="linear"), target)
    print(f"steps: large batch {large}, user's rate {user}, x sqrt(N) {sqrt}, x N {linear}")
    assert sqrt * 2 <= user and linear <= 1.5 * large


def test_annealing_the_workers_rate_is_sooner_than_sqrt_and_ends_below_its_floor(reference):
    """The default for Adam's kin (`"anneal"`: N after its warm-up over the first quarter,
    falling toward the user's rate as 1/t) reaches the target sooner than sqrt(N),
    within twice N's steps (here 571 against 771 and 331: the quarter's warm-up is what it
    pays where nothing early needs it), and ends below sqrt(N)'s noise floor: averaging N
    windows divides their noise variance by N, so at the user's rate the averaged noise is
    below one worker's."""
    target, _ = reference
    asynchronous = outer_optimizers.default_outer_optimizer(WORKERS)
    curves = {
        rule: window_curve(asynchronous, False, lr_scaling=rule)
        for rule in ("sqrt", "linear", "anneal")
    }
    steps = {rule: steps_to(curve, target) for rule, curve in curves.items()}
    floor = {rule: float(np.mean(curve[-STEPS // 10 :])) for rule, curve in curves.items()}
    print(f"steps to the target {steps}, final loss {floor}")
    assert steps["anneal"] <= 2 * steps["linear"] and steps["anneal"] < steps["sqrt"]
    assert floor["anneal"] < floor["sqrt"] < floor["linear"]


@pytest.mark.parametrize("workers", [1, 2, 4, 8, 10, 16, 64])
def test_synchronous_default_gain_is_n_with_a_stable_rate(workers):
    opt = outer_optimizers.default_synchronous_outer_optimizer(workers)
    assert outer_optimizers.outer_gain(opt, workers) == pytest.approx(workers)
    if workers > 1:
        # A round's rate stays below Nesterov's limit where windows converge: 2 (1 + m) / (1 + 2 m).
        assert opt.learning_rate <= 1.0 < 2 * (1 + opt.momentum) / (1 + 2 * opt.momentum)
        assert opt.delay == workers
