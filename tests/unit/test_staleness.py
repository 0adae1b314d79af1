"""The staleness rule (`rules/staleness.py`), against values worked out by hand."""

import numpy as np
import pytest
import tensorflow.experimental.numpy as tnp

from tf_asgd.rules import staleness


def test_staleness_scales():
    taus = np.array([0, 1, 3, 9])
    np.testing.assert_allclose(staleness.staleness_scale(taus, "none"), [1, 1, 1, 1])
    np.testing.assert_allclose(staleness.staleness_scale(taus, "dynsgd"), [1, 0.5, 0.25, 0.1])
    np.testing.assert_allclose(
        staleness.staleness_scale(taus, "dynsgd", max_staleness=2), [1, 0.5, 0, 0]
    )


def test_numpy_and_tf_agree():
    taus = np.arange(6)
    np.testing.assert_allclose(
        staleness.staleness_scale(taus, "dynsgd", 3),
        np.asarray(staleness.staleness_scale(taus, "dynsgd", 3, xp=tnp)),
    )


def test_apply_push():
    out = staleness.apply_push(np.array([1.0, 2.0]), np.array([4.0, -4.0]), tau=3, rule="dynsgd")
    np.testing.assert_allclose(out, [2.0, 1.0])


@pytest.mark.parametrize(
    "rule,max_staleness,match",
    [
        ("adagrad", None, "Unknown staleness rule 'adagrad'"),
        ("dynsgd", -1, "max_staleness must be >= 0"),
        ("none", 1.5, "max_staleness must be a non-negative integer"),
    ],
)
def test_bad_staleness_config(rule, max_staleness, match):
    with pytest.raises(ValueError, match=match):
        staleness.validate_staleness(rule, max_staleness)
