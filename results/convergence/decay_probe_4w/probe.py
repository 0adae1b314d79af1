"""One-off probe (not a tool; kept to rerun this directory): an outer rate that starts at
2/N and falls linearly to the default over the first 45 pushes (half of the 90 pushes of 4
workers at n_sync 10 for 20 epochs), through `OuterSGD`'s warm-up arguments.

    python results/convergence/decay_probe_4w/probe.py --out DIR --models mlp --optimizers adam \
        --workers 4 --n-sync 10 --setups decay --seeds 5 --epochs 20
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))
import convergence  # noqa: E402

_orig = convergence.strategy_kwargs

def strategy_kwargs(setup, workers):
    if setup in ("decay", "decay_2"):
        from tf_asgd import update_rules as rules
        lr = rules.default_outer_learning_rate(workers)
        return dict(outer_optimizer=rules.OuterSGD(lr, warmup_pushes=45, warmup_learning_rate=2.0 / workers))
    return _orig(setup, workers)

convergence.strategy_kwargs = strategy_kwargs
convergence.SETUPS = convergence.SETUPS + ("decay", "decay_2")
sys.exit(convergence.main(sys.argv[1:]))
