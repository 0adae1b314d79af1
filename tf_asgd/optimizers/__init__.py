"""Optimizers for asynchronous training.

`GEM` wraps a worker's Keras optimizer and rescales each push. `OuterSGD` and
`DelayedNesterov` are the parameter servers' outer optimizers (the strategy's
`outer_optimizer`); they are defined with the pure update rules
(`tf_asgd.rules.outer_optimizers`), which the simulator and the tests reuse, and are also
`tf_asgd.OuterSGD` and `tf_asgd.DelayedNesterov`.
"""

from tf_asgd.optimizers.gem import GEM
from tf_asgd.rules.outer_optimizers import DelayedNesterov, OuterSGD

__all__ = ["GEM", "DelayedNesterov", "OuterSGD"]
