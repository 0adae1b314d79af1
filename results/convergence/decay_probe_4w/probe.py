"""One-off probe (not a tool; kept to rerun this directory).

- `decay` (and `decay_2`, a second set): an outer rate that starts at 2/N and falls
  linearly to the default over the first 45 pushes (half of the 90 pushes of 4 workers at
  n_sync 10 for 20 epochs), through `OuterSGD`'s warm-up arguments.
- `round_decay`: 1/N rising to 2/N over the first N pushes (the first round), then 2/N
  falling to the default over the next 10N; a piecewise rate that `OuterSGD` cannot
  express, so the probe replaces `update_rules.outer_learning_rate` for that optimizer
  (the chief traces the PS ops with it).

    python results/convergence/decay_probe_4w/probe.py --out DIR --models mlp --optimizers adam \
        --workers 4 --n-sync 10 --setups decay --seeds 5 --epochs 20
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))
import convergence  # noqa: E402

from tf_asgd import update_rules  # noqa: E402

_orig = convergence.strategy_kwargs
_orig_rate = update_rules.outer_learning_rate
ROUND_DECAY = {}  # id(OuterSGD) -> workers


def outer_learning_rate(opt, ticket, xp=update_rules.np):
    n = ROUND_DECAY.get(id(opt))
    if n is None:
        return _orig_rate(opt, ticket, xp=xp)
    t = xp.asarray(ticket, dtype=xp.float64)
    rising = 1.0 / n + (1.0 / n) * xp.minimum(t / n, 1.0)
    falling = 2.0 / n + (opt.learning_rate - 2.0 / n) * xp.minimum(xp.maximum(t - n, 0.0) / (10.0 * n), 1.0)
    return xp.where(t < n, rising, falling)


update_rules.outer_learning_rate = outer_learning_rate

def strategy_kwargs(setup, workers):
    if setup in ("decay", "decay_2"):
        from tf_asgd import update_rules as rules
        lr = rules.default_outer_learning_rate(workers)
        return dict(outer_optimizer=rules.OuterSGD(lr, warmup_pushes=45, warmup_learning_rate=2.0 / workers))
    if setup in ("round_decay", "round_decay_2"):
        opt = update_rules.OuterSGD(update_rules.default_outer_learning_rate(workers))
        ROUND_DECAY[id(opt)] = workers
        return dict(outer_optimizer=opt)
    return _orig(setup, workers)

convergence.strategy_kwargs = strategy_kwargs
convergence.SETUPS = convergence.SETUPS + ("decay", "decay_2", "round_decay", "round_decay_2")
sys.exit(convergence.main(sys.argv[1:]))
