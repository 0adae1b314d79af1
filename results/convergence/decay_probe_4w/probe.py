"""One-off probe (not a tool; kept to rerun this directory).

- `decay` (and `decay_2`, a second set): an outer rate that starts at 2/N and falls
  linearly to the default over the first 45 pushes (half of the 90 pushes of 4 workers at
  n_sync 10 for 20 epochs).
- `round_decay` (and `round_decay_2`): 1/N rising to 2/N over the first N pushes (the
  first round), then 2/N falling to the default over the next 10N. On 4 workers this is
  the default since session 8 (`update_rules.default_outer_optimizer`). When these runs
  were made `OuterSGD` had no `schedule`, and the probe replaced
  `update_rules.outer_learning_rate` with the same piecewise rate.

    python results/convergence/decay_probe_4w/probe.py --out DIR --models mlp --optimizers adam \
        --workers 4 --n-sync 10 --setups decay --seeds 5 --epochs 20
"""

import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools")
)
import convergence

from tf_asgd import update_rules

_orig = convergence.strategy_kwargs


def strategy_kwargs(setup, workers):
    lr = update_rules.default_outer_learning_rate(workers)
    if setup in ("decay", "decay_2"):
        return dict(outer_optimizer=update_rules.OuterSGD(lr, schedule=((45, 2.0 / workers),)))
    if setup in ("round_decay", "round_decay_2"):
        return dict(
            outer_optimizer=update_rules.OuterSGD(
                lr, schedule=((workers, 1.0 / workers), (10 * workers, 2.0 / workers))
            )
        )
    return _orig(setup, workers)


convergence.strategy_kwargs = strategy_kwargs
convergence.SETUPS = convergence.SETUPS + ("decay", "decay_2", "round_decay", "round_decay_2")
sys.exit(convergence.main(sys.argv[1:]))
