"""Data sets that work offline.

`load_digits` is scikit-learn's 8x8 handwritten digits (1,797 images, shipped
inside the package), the offline default of the tests and the launcher.
"""

import numpy as np


def load_digits(test_fraction=0.2, seed=0):
    """Returns `((x_train, y_train), (x_test, y_test))`, images 8x8x1 in [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        raise ImportError(
            "The digits data set ships with scikit-learn: pip install scikit-learn"
        ) from e
    digits = sk_load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = int(round(len(x) * test_fraction))
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])
