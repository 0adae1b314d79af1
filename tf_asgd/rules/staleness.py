"""The PS's rule for a push: the staleness scale, then the outer step.

Each rule is a function of arrays and an array namespace `xp` (`numpy` or
`tensorflow.experimental.numpy`): one definition serves the PS's TF ops, the simulator
and the tests' references. The outer step itself: `outer_optimizers`.

Example:
    >>> import numpy as np
    >>> from tf_asgd.rules import staleness
    >>> float(staleness.staleness_scale(3, "dynsgd"))
    0.25
    >>> staleness.apply_push(np.zeros(2), np.ones(2), tau=1, rule="dynsgd")
    array([0.5, 0.5])
"""

import numpy as np

from tf_asgd.rules import outer_optimizers

STALENESS_RULES = ("none", "dynsgd")


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
        outer: `outer_optimizers.OuterSGD` or `DelayedNesterov`; default `OuterSGD()`.
        num_workers: the number of workers (`DelayedNesterov`'s default delay).

    Returns:
        `(new_central, new_state)`.
    """
    scale = xp.asarray(staleness_scale(tau, rule, max_staleness, xp=xp), dtype=update.dtype)
    return outer_optimizers.outer_step(
        outer or outer_optimizers.OuterSGD(),
        central,
        -scale * update,
        state,
        ticket,
        num_workers,
        xp=xp,
    )
