"""The supported Keras / TensorFlow range: refused clearly outside it, the
same range in pyproject.toml and in the check (tools/dev/compat.py measures it)."""

import os
import pickle
import re

import numpy as np
import pytest

from tf_asgd import data

from helpers import ROOT, supported_versions


def test_pyproject_admits_exactly_the_supported_range():
    keras_minors, tf_minors = supported_versions()
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()

    def upper(minor):
        major, m = minor.split(".")
        return f"{major}.{int(m) + 1}"

    assert f'"keras>={keras_minors[0]},<{upper(keras_minors[-1])}"' in text
    for name in ("tensorflow", "tensorboard", "tensorflow[and-cuda]", "tf-keras"):
        pins = re.findall(rf'"{re.escape(name)}([<>=][^"]*)"', text)
        assert pins and set(pins) == {f">={tf_minors[0]},<{upper(tf_minors[-1])}"}, (name, pins)
    for minors in (keras_minors, tf_minors):  # consecutive minors, no gap
        nums = [int(m.split(".")[1]) for m in minors]
        assert nums == list(range(nums[0], nums[0] + len(nums)))


def test_cifar_batches_are_read_without_running_pickled_code(tmp_path):
    batch = {b"data": np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072), b"labels": [3, 7]}
    with open(tmp_path / "good", "wb") as f:
        pickle.dump(batch, f)
    x, y = data.load_cifar_batch(str(tmp_path / "good"))
    assert x.shape == (2, 3, 32, 32) and x.dtype == np.uint8 and list(y) == [3, 7]

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with open(tmp_path / "evil", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(pickle.UnpicklingError, match="Refusing to unpickle"):
        data.load_cifar_batch(str(tmp_path / "evil"))
    assert not (tmp_path / "pwned").exists()
