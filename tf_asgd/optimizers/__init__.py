"""Optimizers for asynchronous training: `GEM`."""

from tf_asgd.optimizers.gem import GEM

__all__ = ["GEM"]
