"""Optimizers for asynchronous training: `GEM`."""

from tf_asgd.gem import GEM

__all__ = ["GEM"]
