"""GEM's push rule on a worker (Hermans & Louppe 2018): energy matching.

`gem_step` rescales a worker's update element-wise by `gem_pi` (clipped to
`[0, pi_max]`), so that the push and how far the central variable moved since the
worker's previous pull together match `kappa` times its proxy momentum. Pure: arrays and an
array namespace `xp` (`numpy` or `tensorflow.experimental.numpy`), for
`optimizers.gem.GEM`, the simulator and the tests' references.
"""

import numpy as np

# Defaults of the GEM reference code (Hermans & Louppe 2018).
GEM_PI_MAX = 5.0
GEM_EPSILON = 1e-12


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
