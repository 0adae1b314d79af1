"""GEM's push rule (`rules/gem_rule.py`), against values worked out by hand."""

import numpy as np
import tensorflow.experimental.numpy as tnp

from tf_asgd.rules import gem_rule


def test_numpy_and_tf_agree():
    rng = np.random.default_rng(0)
    g, m, dc = (rng.normal(size=20).astype("float32") for _ in range(3))
    ref = gem_rule.gem_step(g, m, dc, 0.9, 2.0)
    got = gem_rule.gem_step(tnp.asarray(g), tnp.asarray(m), tnp.asarray(dc), 0.9, 2.0, xp=tnp)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6)


def test_gem_pi_by_hand():
    # kappa|m| - |dc| over |g|: (2*0.5 - 0.1)/0.3 = 3; clipped at 5 and at 0.
    g, m, dc = np.array([0.3, 0.1, 0.3]), np.array([0.5, 1.0, 0.01]), np.array([0.1, 0.0, 0.5])
    np.testing.assert_allclose(gem_rule.gem_pi(g, m, dc, kappa=2.0), [3.0, 5.0, 0.0], rtol=1e-9)
    pushed, new_m, pi = gem_rule.gem_step(g, m, dc, mu=0.5, kappa=1.0)
    np.testing.assert_allclose(new_m, 0.5 * m + g)
    np.testing.assert_allclose(pushed, pi * g)
