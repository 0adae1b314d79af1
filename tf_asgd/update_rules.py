"""Pure update rules: staleness scaling on the PS and GEM's energy matching.

Every rule here is a small function of arrays and an array namespace `xp`
(`numpy` or `tensorflow.experimental.numpy`), so that one definition serves
the cluster path (TF ops placed on the PS or the worker), the many-worker
simulator (NumPy) and the tests' references.

Example:

>>> import numpy as np
>>> from tf_asgd import update_rules
>>> float(update_rules.staleness_scale(3, "dynsgd"))
0.25
>>> update_rules.apply_push(np.zeros(2), np.ones(2), tau=1, rule="dynsgd")
array([0.5, 0.5])
"""

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
        if isinstance(max_staleness, bool) or not isinstance(
            max_staleness, (int, np.integer)
        ):
            raise ValueError(
                f"max_staleness must be a non-negative integer or None, "
                f"got {max_staleness!r}."
            )
        if max_staleness < 0:
            raise ValueError(
                f"max_staleness must be >= 0, got {max_staleness}."
            )


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
    """The PS rule: `central + scale(tau) * update`."""
    scale = staleness_scale(tau, rule, max_staleness, xp=xp)
    return central + xp.asarray(scale, dtype=update.dtype) * update


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
